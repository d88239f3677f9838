export PYTHONPATH=$PWD  # a fresh machine: install first (run.sh does it too)
python -c "import dsv4c" 2>/dev/null || python -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
# A/B of this session's step changes on the 2-layer slice (fp8_block experts), same tree, interleaved:
#   new      = as committed (step-wide PDL, fuse_hc_chain)
#   pdl-off  = pdl_switch.py off (every kernel launched as before e17debf; the FP4 chain keeps its own PDL)
#   no-chain = --skip-passes fuse_hc_chain
R=examples/results/device-2026-12-05e/run36
for v in 1:new 1:pdl-off 1:no-chain 8:new 8:pdl-off 8:no-chain 1:new 1:pdl-off 1:no-chain; do
  b=${v%%:*}; m=${v##*:}
  sw=on; extra=""
  [ "$m" = pdl-off ] && sw=off
  [ "$m" = no-chain ] && extra="--skip-passes fuse_hc_chain"
  python $R/pdl_switch.py $sw examples/profile_step.py --layers 2 --batch $b --expert-format fp8_block --top 45 \
    $extra --out $OUT/prof_${m}_b${b}.json > /tmp/p.txt 2>&1
  grep "^== full\|^== graphs\|Error\|error" /tmp/p.txt | sed "s/^/$m b=$b /" | tee -a $OUT/ab.txt
  cp /tmp/p.txt $OUT/prof_${m}_b${b}.txt
done
