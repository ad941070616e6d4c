"""Starting and watching a build's ranks on this machine or a cluster: the launcher (`meshplan run`),
the per-rank worker, a rank's state, its contact with the others and its training run (rank_session,
rank_contact, rank_steps: what runtime/rank_main.py calls), where each rank runs (placement, shared
directories), fault injection, the watchdog and progress. The entry points a build's own scripts name
(runtime/rank_main.py, runtime/join.py, runtime/loopback_ns.py, runtime/torchrun_local.py) stay at
runtime/'s top, where builds written earlier import them. The package itself imports nothing."""
