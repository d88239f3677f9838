# run45 (twenty-seventh session, any GPU, ~7 min): the deterministic decode tile with 2 / 4 groups of 16 token
# rows per program past 16 rows (`decode_groups`): its GPU tests (rows alone equal rows among 100; the
# deterministic mode's tokens across batch 1 / 8 / 64 and MTP k = 0..3), the three modes' steps at batch
# 1 / 8 / 64 (run44 timed them before the change, same machine kind), a deterministic verify call of 1 + 3
# tokens per row at batch 64 profiled (run44: 16.45 ms, batch-invariant linears 3.67 ms of it); then the
# default batch-1 step profiled with the step-wide PDL off (each kernel's own time, not its wait).
# B=SECONDS budget. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-420}
fits() { if [ $((SECONDS + $1)) -lt $B ]; then return 0; fi; echo "skipped ($1 s would pass B=$B at $SECONDS s): $2"; return 1; }
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 200 python -m pytest -q -m gpu tests/test_kernels_batch_invariant.py tests/test_deterministic.py \
  > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt; tail -3 $OUT/gpu_tests.txt
M="default-mxfp4 deterministic-mxfp4 deterministic-mxfp4-fp8dense"
fits 90 "det modes" && python examples/bench_deterministic.py --layers 2 --modes $M --batches 1 8 64 \
  --out $OUT/det_groups.json 2>&1 | tail -5 | tee -a $OUT/steps.txt
fits 50 "verify profile b64" && python examples/profile_step.py --layers 2 --deterministic \
  --expert-format mxfp4_w4a16 --batch 64 --verify 3 --top 30 --out $OUT/verify3_b64.json > /tmp/v.txt 2>&1
grep "^== \|^| routed\|^| dense\|^| attention\|^| other\|Error" /tmp/v.txt | sed "s/^/verify3 b64 /" | tee -a $OUT/steps.txt
fits 45 "pdl-off profile b1" && python examples/results/device-2026-12-05e/run36/pdl_switch.py off \
  examples/profile_step.py --layers 2 --expert-format mxfp4_w4a16 --batch 1 --top 60 > $OUT/prof_b1_pdl_off.txt 2>&1
grep "^== " $OUT/prof_b1_pdl_off.txt
