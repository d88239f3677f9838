# run81 (any GPU, about 1-2 min; written in the forty-first session): the mHC site (hc_post then hc_pre) at 64 / 32 /
# 16 / 8 tokens, the tree's launch against other tiles, cold and warm L2 (hc64.py). At most 8 files to $OUT.
export PYTHONPATH=$PWD
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
cd examples/results/device-2026-12-07/run81 && timeout ${B:-150} python hc64.py $OUT/hc64.json $((${B:-150} - 30)) 2>&1 | tail -60 | tee $OUT/hc64.log
