"""agentkv's benchmarks, installed as ``agentkv.benchmarks`` and run by ``agentkv bench``.

Every figure is measured in one run, side by side with its baseline, on the
machine described in the output's ``machine`` field. Results: RESULTS.md.
"""
