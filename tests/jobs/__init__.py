"""Job scripts the system tests run as subprocesses (by path: ``python tests/jobs/x.py``,
``torchrun``, ``sapipe-launch``); a package so that a test can read a job's constants."""
