"""The pod's helpers: launch.sh's parts (launch_run.sh, launch_fleet.sh, launch_help.sh,
launch_smoke.sh), the worker side of every command (worker.sh) and smoke's rates and table
(smoke.py)."""
