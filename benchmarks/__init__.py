"""The benchmark studies that run in this process, not over HTTP: bench.py's client benchmark
imports them lazily, each when its command-line flag selects it (`python bench.py --help`).

- common.py: what the client and the studies share: Timing, Result, percentile, the progress
  line, the chat prompts (FILLER, QUESTIONS), time_call
- in_process.py: the model loaded here from the server's environment variables, without
  importing the server (load_in_process); --in-process, --chat --in-process
- kernels.py: --bandwidth (memory_bandwidth), --dtype-sweep, --quant-kernels
- quality.py: --quant-quality, --quant-agreement
- constrained.py: --constrained (TYPICAL_SCHEMA, constrained_outputs_check)
- adapters.py: --adapters (write_random_adapters)

Why `benchmarks` and not `bench`: in one folder a package `bench/` shadows the module `bench.py`
(the import system finds the package first), so `from bench import ...` would stop reaching the
script's names, and the script would share its name with a package it imports. `benchmarks` is
free: no other module, folder or installed package here has that name. common.py holds what
both sides use because an in-process run returns the same Result that bench.py reports.
"""
