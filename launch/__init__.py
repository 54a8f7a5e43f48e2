"""pycoll.launch: the ``pycollrun`` launcher, a thin front end over the installed ``mpiexec``."""
