"""The parallelism planner: `python -m flaxlm.plan --gin_file=... [--topology=...]`.

`run` is what is planned (the run, a candidate, its verdict); `planner` enumerates,
rejects, compiles and predicts; `report` prints and writes what it found; `__main__` is the
command line (flaxlm.main with gin/runs/plan.gin after the run's Gin files). Nothing here is
imported by a training run.
"""
