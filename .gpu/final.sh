# session 50 final call: cold start after streamed weights, filling threads, and slow pipelines not waited for
build_llama > $OUT/llb.txt 2>&1
f=$(synth_model llama:1b:q4_0)
echo "== cold start 1B"
timeout 200 python3 bench/cold_start.py --model $f --llama-server /tmp/llb/bin/llama-server --threads 16 \
  --json $OUT/cold-1b.json 2>&1 | tail -8
f8=$(synth_model llama:8b:q4_0)
echo "== cold start 8B"
timeout 200 python3 bench/cold_start.py --model $f8 --llama-server /tmp/llb/bin/llama-server --threads 16 \
  --json $OUT/cold-8b.json 2>&1 | tail -8
echo "== tests"
timeout 170 python3 -m pytest -q -p no:cacheprovider -x tests/test_quant_stream.py tests/test_pipeline_cache.py \
  tests/test_models.py -k "not smollm" 2>&1 | tail -4
