"""Engines turn a ``Plan`` into work on a runtime: ``local`` (threads in this
process), ``dask_engine`` (a distributed cluster), ``mpi`` (SUMMA under mpirun).
Engines know nothing of kernels: they call an executor.
"""
