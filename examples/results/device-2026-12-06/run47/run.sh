# run47 call A (planned, any GPU, ~8 min): issue 28's "one run" with every peer. The full slice through
# `dsv4c compile` + `dsv4c bench` (decode at batch 1 / 8 / 64; no long context or prefill: run46 timed them,
# and the peers' minutes must fit the call) with the eager reference, torch.compile of it and HF
# transformers' DeepseekV4 (batch 1 / 8:
# its eager attention's prefill at 64 x 1024 tokens does not fit beside the two models) timed in the same
# run, and the pinned-routing SNR of the artifact (HF's own SNR against eager beside it).
# B=SECONDS budget. At most 8 files to $OUT.
export PYTHONPATH=$PWD
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
timeout $((${B:-580} - SECONDS)) python examples/bench_artifact.py --work /tmp/slice --out $OUT/artifact.json \
  --prefill > $OUT/artifact.log 2>&1; echo rc=$? >> $OUT/artifact.log
tail -24 $OUT/artifact.log
cp /tmp/slice/compile.log $OUT/artifact_compile.log 2>/dev/null
rm -rf /tmp/slice
