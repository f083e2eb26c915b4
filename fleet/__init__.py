"""Studies over a fleet of VMs (study.py is the command line): the study file and its plan
(plan.py), the runs claimed under a lease and each trained as a train.py process (runner.py,
claims.py), one trainer per run (fencing.py), the test-time grid (testtime_grid.py), and the
report: table, plots, goodput (report.py, plots.py, goodput.py). The fleet reads a run through
its directory's contract and a subprocess, never through the loop's code."""
