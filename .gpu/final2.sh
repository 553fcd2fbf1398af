# next session, call 1: cold start after 67743bd/bd1eeb5 (issue 35 item 6), 1B and 8B beside llama-server, then GPU tests
# GPU_CMD="bash .gpu/final2.sh" T_cmd=580 tests/gpu/run_on_gpu.sh cmd, carry [".vk", ".spv"]
build_llama > $OUT/llb.txt 2>&1
f=$(synth_model llama:1b:q4_0)
echo "== cold start 1B"
timeout 170 python3 bench/cold_start.py --model $f --llama-server /tmp/llb/bin/llama-server --threads 16 --timeout 100 \
  --json $OUT/cold-1b.json 2>&1 | tail -8
f8=$(synth_model llama:8b:q4_0)
echo "== cold start 8B"
timeout 200 python3 bench/cold_start.py --model $f8 --llama-server /tmp/llb/bin/llama-server --threads 16 --timeout 100 \
  --json $OUT/cold-8b.json 2>&1 | tail -8
python3 -c "import json; [print(r['config'], r.get('startup_log')) for r in json.load(open('$OUT/cold-8b.json'))['results']]"
VKENGINE_LLAMA_SERVER=/tmp/llb/bin/llama-server timeout 100 python3 -m pytest -q -p no:cacheprovider \
  tests/test_models.py tests/test_pipeline_cache.py tests/test_quant_stream.py -k "not smollm" 2>&1 | tail -3
