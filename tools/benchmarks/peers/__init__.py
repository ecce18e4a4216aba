"""The pieces of ``tools/benchmarks/bench_peers.py``: the workload every system trains on
(:mod:`peers.workload`), the training loop the peers share (:mod:`peers.training`), the
systems (:mod:`peers.hf`, :mod:`peers.titan`, :mod:`peers.ours`), the search for a system's
longest sequence (:mod:`peers.longest`) and the report (:mod:`peers.report`)."""
