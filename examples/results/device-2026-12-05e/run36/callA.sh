# run36 call A: the step A/B (ab.sh) and the argmax microbench; call B: the GPU tests (run.sh) and sweep.sh
export PYTHONPATH=$PWD
R=examples/results/device-2026-12-05e/run36
python -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
python $R/argmax_bench.py $OUT/argmax.json > $OUT/argmax.txt 2>&1
bash $R/ab.sh
