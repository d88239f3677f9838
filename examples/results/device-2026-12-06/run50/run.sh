# run50 (twenty-eighth session, tree `4f9c240`, any GPU, ~4 min; reverted after it: the 4-row block took twice
# the time): the deterministic hc_pre's row launch with 4 token rows per
# program (`HC_DET_ROWS`: each fn tile loaded once for 4 rows; run49's verify of 1 + 3 tokens at batch 64 spent
# 310 us in `_hc_mix_rows_kernel`). GPU tests (hc_pre_rows' rows across token counts; the 2-layer Flash
# model bit-identical across batch and k in the three deterministic modes), then the verify call profiled
# with R = 4 and R = 1 (hc_rows.py), FP8 block experts, batch 64.
# At most 8 files to $OUT.
export PYTHONPATH=$PWD
R=examples/results/device-2026-12-06/run50
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 130 python -m pytest -q -m gpu tests/test_fuse_hc.py tests/test_deterministic.py \
  -k "deterministic_ops or flash_two_layer" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
tail -2 $OUT/gpu_tests.txt
for r in 4 1; do
  timeout 60 python $R/hc_rows.py $r examples/profile_step.py --layers 2 --deterministic --expert-format fp8_block \
    --batch 64 --verify 3 --top 20 > $OUT/verify3_b64_rows$r.txt 2>&1
  grep "^== full\|^| _hc_mix_rows_kernel\|Error" $OUT/verify3_b64_rows$r.txt | sed "s/^/rows $r: /" \
    | tee -a $OUT/steps.txt
done
