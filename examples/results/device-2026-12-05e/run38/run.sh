# run38 (~80 s): c1fa12a's decode tile for the deterministic linears. The batch-invariant kernels' GPU tests
# (rows at M = 1 / 8 / 17 the bits of M = 64, decode tile and split), then the deterministic step at batch 1
# and 8 on the 2-layer slice with MXFP4 experts, as run37's `split on` rows (2.616 / 3.026 ms).
export PYTHONPATH=$PWD
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/det.txt
timeout 60 python -m pytest -q -m gpu tests/test_kernels_batch_invariant.py -k "bi_matmul_rows_on_gpu or invariant_ops" \
  > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt; tail -2 $OUT/gpu_tests.txt
for b in 1 8; do
  python examples/profile_step.py --layers 2 --batch $b --deterministic --expert-format mxfp4_w4a16 --top 45 \
    --out $OUT/det_b$b.json > /tmp/det_b$b.txt 2>&1
  grep "^== \|^| routed\|^| dense\|^| attention\|^| other\|Error" /tmp/det_b$b.txt | sed "s/^/decode tile b=$b /" \
    | tee -a $OUT/det.txt
done
