# run40 call A (planned, ~8 min, any GPU; H100: the 2-layer slice). B=SECONDS budget, parts that would not fit are
# skipped and say so. At most 8 files to $OUT.
# 1. the indexer's staged selection against the one-program one (kernel A/B, contexts 8192..262144)
# 2. the deterministic step after 05c2ebd (sum_bi as one program per row), decode tile T = 16 / 32 / 64, beside
#    the default step: the deterministic mode's cost (issue 23 item 4)
# (run_b.sh: PDL on / off at batch 64, then the GPU tests)
export PYTHONPATH=$PWD
B=${B:-480}
fits() { if [ $((SECONDS + $1)) -lt $B ]; then return 0; fi; echo "skipped ($1 s would pass B=$B at $SECONDS s): $2"; return 1; }
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
R=examples/results/device-2026-12-06/run40
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
python $R/indexer_select.py $OUT/indexer_select.json 2>&1 | tail -8
for v in 1:def 1:16 64:def 64:16 1:32 64:32 1:64 64:64 8:def 8:16; do
  b=${v%%:*}; t=${v##*:}
  fits 45 "step $v" | tee -a $OUT/steps.txt | grep -q skipped && continue
  if [ $t = def ]; then
    python examples/profile_step.py --layers 2 --batch $b --expert-format mxfp4_w4a16 --top 45 \
      --out /tmp/s_${v/:/_}.json > /tmp/s.txt 2>&1
  else
    python $R/tile_t.py $t examples/profile_step.py --layers 2 --batch $b --deterministic \
      --expert-format mxfp4_w4a16 --top 45 --out /tmp/s_${v/:/_}.json > /tmp/s.txt 2>&1
  fi
  grep "^== \|^| routed\|^| dense\|^| attention\|^| other\|Error" /tmp/s.txt | sed "s/^/$v /" | tee -a $OUT/steps.txt
done
cp /tmp/s_1_16.json $OUT/det_t16_b1.json 2>/dev/null
