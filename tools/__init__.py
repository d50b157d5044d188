"""Development tools shared by the tests and the benchmarks (not part of the installed packages).

:mod:`tools.launch` starts the ranks of a job, and runs commands, under one policy: a deadline, no rank left running.
"""
