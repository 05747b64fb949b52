"""Channel latency and throughput versus raw Ray; prints a table and writes JSON.

    python benchmarks/channel.py                       # defaults (see rlinf_vla/configs/benchmark/channel.yaml)
    python benchmarks/channel.py benchmark.rounds=5 output_dir=/tmp/bench

The same as `rlinf-vla bench benchmark=channel [overrides]`; results go to
benchmarks/results/channel.json by default.
"""

import sys

from rlinf_vla.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "benchmark=channel", *sys.argv[1:]]))
