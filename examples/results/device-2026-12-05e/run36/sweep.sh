export PYTHONPATH=$PWD  # a fresh machine: install first (run.sh does it too)
python -c "import dsv4c" 2>/dev/null || python -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
# The W8A16 dense GEMV against bf16 F.linear at the slice's dense shapes, with the wide tensor-core tiles swept
python examples/bench_dense_kernels.py --m 1 8 64 --kernels "bf16 linear" "w8a16 gemv" --sweep --budget-s 240 \
  --out $OUT/dense_sweep.json --md $OUT/dense_sweep.md > $OUT/dense_sweep.txt 2>&1
tail -30 $OUT/dense_sweep.md
