#!/bin/bash
# run16: where the prefill time of the prefix-cache benchmark goes (slot artifact only)
cd "$(dirname "$0")/.."
python -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.txt 2>&1
timeout 420 python examples/bench_prefix_cache.py --work /tmp/dsv4c_pc --out $OUT/prefix_profile.json --runs on,warm --profile-prefill > $OUT/profile_log.txt 2>&1
echo "rc=$?" >> $OUT/profile_log.txt
grep -v USDT $OUT/profile_log.txt | tail -80
