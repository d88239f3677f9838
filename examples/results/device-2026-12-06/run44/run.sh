# run44 (twenty-seventh session, any GPU, ~9.5 min): where the default batch-1 / 64 step goes now (FP8 dense,
# MXFP4 experts: the h100/h200 targets' formats since `49f951b`), then run43 (the deterministic mode's
# fp8_linear_bi: GPU tests and cost; a deterministic verify profiled) in the time left.
# At most 8 files to $OUT: prof_b1.txt, prof_b64.txt + run43's six.
export PYTHONPATH=$PWD
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
for b in 1 64; do
  timeout 100 python examples/profile_step.py --layers 2 --expert-format mxfp4_w4a16 --batch $b --top 45 \
    --out /tmp/p$b.json > $OUT/prof_b$b.txt 2>&1; echo rc=$? >> $OUT/prof_b$b.txt
  grep "^== " $OUT/prof_b$b.txt
done
B=$((${B:-580} - SECONDS)) bash examples/results/device-2026-12-06/run43/run.sh
