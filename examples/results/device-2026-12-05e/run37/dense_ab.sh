# run37, call 2 of 2 (~4 min): the 2-layer slice's decode step with its FP8-stored dense linears as bf16 (h200's
# default) and on the W8A16 GEMV (--dense-format fp8_block_w8a16), interleaved, batch 1 / 8 / 64, same tree.
# Decides issue 28 item 1: whether the GPU targets' dense_format becomes fp8_block_w8a16.
export PYTHONPATH=$PWD
python -c "import dsv4c" 2>/dev/null || python -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
for v in 1:bf16 1:fp8_block_w8a16 8:bf16 8:fp8_block_w8a16 64:bf16 64:fp8_block_w8a16; do
  b=${v%%:*}; f=${v##*:}
  python examples/profile_step.py --layers 2 --batch $b --expert-format fp8_block --dense-format $f --top 45 \
    --out $OUT/dense_${f}_b$b.json > /tmp/p.txt 2>&1
  grep "^== full\|Error\|error" /tmp/p.txt | sed "s/^/$f b=$b /" | tee -a $OUT/dense_ab.txt
  grep "^| dense\|^| routed\|^| other\|^| attention" /tmp/p.txt | sed "s/^/$f b=$b /" >> $OUT/dense_ab.txt
done
