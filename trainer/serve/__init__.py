"""A warm process that runs commands: `python -m trainer.serve` imports Hydra, torch and the
trainer once and keeps them; while it runs, `python -m trainer ...` in the same environment
hands its command line to it and gets a process forked from it, which starts training without
paying those imports again. Opt-in: without a server every command runs as it always has.

    protocol.py  where the server listens and which environments match (stdlib only)
    client.py    the hand-over from `python -m trainer` (stdlib only: before any import)
    server.py    the server: preload, accept, fork, report each run's exit
    child.py     a run's process, forked from the server
"""
