# call 1: mul_mc2 variants (scales, BK), llama.cpp's per-op times for the 8B pp512, our profile, the mixed scenario
echo "== probe"
timeout 150 python3 bench/mm_probe.py --types q4_0 --kinds mc2h_128x256,mc2h_256x256,mc2h_128x128,mc2h_256x128,mc2h_64x128,mc2h_64x256,mc2h_128x64,mc2h_128x256s1,mc2h_128x256s2,mc2h_128x256k64,mc2h_128x256k64s2,mc2h_128x256k64u8s2,mc2h_128x256k64s1,mc2h_256x256s2,mc2h_256x256k64s2,mc2h_64x256s2,mc2h_64x256k64s2 -n 512 --out $OUT/mm-probe.json 2>&1 | grep -v "^\s*$" | tail -80
build_llama > $OUT/llb.txt 2>&1
f=$(synth_model llama:8b:q4_0)
echo "== llama.cpp per-op pp512"
GGML_VK_PERF_LOGGER=1 timeout 60 /tmp/llb/bin/llama-bench -m $f -p 512 -n 0 -r 1 -ngl 99 > $OUT/perf.txt 2>&1
awk '/Vulkan Timings/{b=""} {b=b"\n"$0} END{print b}' $OUT/perf.txt | grep -E "MUL_MAT|Total|FLASH|pp512" | head -30
echo "== ours profile pp512"
timeout 90 python3 -m vkengine.cli bench --model $f -p 512 -n 0 -r 1 --profile 2>&1 | tail -40
echo "== mixed"
la="-ngl 99 --override-kv llama.context_length=int:131072"
timeout 230 python3 bench/serve.py --model "$f" --clients 4 -n 256 --newcomers 4 --newcomer-ids 8192 --newcomer-predict 16 \
  --ctx 8256 --llama-server /tmp/llb/bin/llama-server --llama-args="$la" --server-args="--step-log $OUT/steps.jsonl" \
  --keep-logs $OUT/serve-logs --json "$OUT/serve-mixed.json" 2>&1 | tail -6
