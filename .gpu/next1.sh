# next session, call 1 (prepared 2026-12-04): the landed defaults measured end to end, beside llama.cpp, one call.
# Run: GPU_CMD="bash .gpu/next1.sh" T_cmd=570 tests/gpu/run_on_gpu.sh cmd, carry [".vk", ".spv"] (rebuild .spv fresh first)
build_llama > $OUT/llb.txt 2>&1
f=$(synth_model llama:8b:q4_0)
# warm the driver's pipeline cache first (a fresh machine builds pipelines for ~50 s: notes.md run 37)
timeout 200 python3 -m vkengine.cli bench --model $f -p 512 -n 8 -r 1 > /dev/null 2>&1
echo "== 8B pp512 / pp4096 / tg at depth, ours then llama-bench"
timeout 60 python3 -m vkengine.cli bench --model $f -p 512 -n 0 -r 3 2>&1 | tail -1
timeout 60 python3 -m vkengine.cli bench --model $f -p 4096 -n 0 -r 2 --ctx 4352 2>&1 | tail -1
timeout 120 python3 -m vkengine.cli bench --model $f -p 0 -n 64 -d 4096,16384 -r 2 --ctx 16640 2>&1 | tail -2
timeout 60 /tmp/llb/bin/llama-bench -m $f -p 512,4096 -n 0 -r 3 -ngl 99 2>&1 | grep -E "pp|error"
timeout 90 /tmp/llb/bin/llama-bench -m $f -p 0 -n 64 -d 4096,16384 -r 2 -ngl 99 2>&1 | grep -E "tg|error"
echo "== 8B prefill profile (down/o on 64-deep slices)"
timeout 60 python3 -m vkengine.cli bench --model $f -p 512 -n 0 -r 1 --profile 2>&1 | sed -n '/^prefill/,$p' | head -8
echo "== mixed scenario (chunks in whole tiles; both servers warmed with one 8k prompt)"
la="-ngl 99 --override-kv llama.context_length=int:131072"
timeout 220 python3 bench/serve.py --model "$f" --clients 4 -n 256 --newcomers 4 --newcomer-ids 8192 --newcomer-predict 16 \
  --ctx 8256 --llama-server /tmp/llb/bin/llama-server --llama-args="$la" --server-args="--step-log $OUT/steps.jsonl" \
  --keep-logs $OUT/serve-logs --json "$OUT/serve-mixed.json" 2>&1 | tail -4
