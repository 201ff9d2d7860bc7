"""The interpreter start-up hook directory (see sitecustomize.py); kprof puts it on PYTHONPATH."""
