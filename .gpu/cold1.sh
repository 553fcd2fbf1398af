# session 50, call 5: cold start (issue 35 item 6) then the 8B figures of issue 31 (next1's first part).
# GPU_CMD="bash .gpu/cold1.sh" T_cmd=580 tests/gpu/run_on_gpu.sh cmd, carry [".vk", ".spv"]
build_llama > $OUT/llb.txt 2>&1
python3 -c "import kp; print('kp pipeline cache patch:', getattr(kp, 'VKENGINE_PIPELINE_CACHE', None))"
f=$(synth_model llama:1b:q4_0)
echo "== cold start 1B"
timeout 240 python3 bench/cold_start.py --model $f --llama-server /tmp/llb/bin/llama-server --threads 1,16 \
  --json $OUT/cold-1b.json 2>&1 | tail -9
f8=$(synth_model llama:8b:q4_0)
echo "== cold start 8B"
timeout 200 python3 bench/cold_start.py --model $f8 --llama-server /tmp/llb/bin/llama-server --threads 16 \
  --runs fresh,warm --json $OUT/cold-8b.json 2>&1 | tail -6
echo "== 8B pp512 composed default, ours then llama-bench (driver cache warmed by a first run)"
timeout 90 python3 -m vkengine.cli bench --model $f8 -p 512 -n 8 -r 1 > /dev/null 2>&1
timeout 40 python3 -m vkengine.cli bench --model $f8 -p 512 -n 0 -r 3 2>&1 | tail -1
timeout 40 /tmp/llb/bin/llama-bench -m $f8 -p 512 -n 0 -r 3 -ngl 99 2>&1 | grep -E "pp|error"
