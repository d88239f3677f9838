#!/bin/bash
# run20 (sent inline, on the warm H100 right after run19): the prefix-cache bench, slot and paged caches,
# Session.load(warm_up=True) (the bench asks for it)
cd "$(dirname "$0")/../../../.."
export PYTHONUNBUFFERED=1
timeout 560 python examples/bench_prefix_cache.py --paged --work /tmp/pc --out $OUT/pc_paged.json > $OUT/pc_log.txt 2>&1; echo rc=$?
grep -v USDT $OUT/pc_log.txt | grep -v "^ " | tail -30
