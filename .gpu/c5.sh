# call 5: the landed defaults: k64 kernel tests, 8B pp512 beside llama-bench, the mixed scenario (chunks of whole tiles, long warm-up)
timeout 40 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "mc2hk64" --tb=short > $OUT/kt.log 2>&1; tail -1 $OUT/kt.log
build_llama > $OUT/llb.txt 2>&1
f=$(synth_model llama:8b:q4_0)
timeout 60 python3 -m vkengine.cli bench --model $f -p 512 -n 0 -r 3 2>&1 | tail -1
timeout 30 /tmp/llb/bin/llama-bench -m $f -p 512 -n 0 -r 3 -ngl 99 2>&1 | grep -E "pp512|error"
la="-ngl 99 --override-kv llama.context_length=int:131072"
timeout 150 python3 bench/serve.py --model "$f" --clients 4 -n 256 --newcomers 4 --newcomer-ids 8192 --newcomer-predict 16 \
  --ctx 8256 --llama-server /tmp/llb/bin/llama-server --llama-args="$la" --server-args="--step-log $OUT/steps.jsonl" \
  --keep-logs $OUT/serve-logs --json "$OUT/serve-mixed.json" 2>&1 | tail -4
