# call 4: mul_mc2's 64-deep form: the 8B pp512 profile A/B in the engine, llama-bench beside, its kernel tests
build_llama > $OUT/llb.txt 2>&1
f=$(synth_model llama:8b:q4_0)
timeout 50 /tmp/llb/bin/llama-bench -m $f -p 512 -n 0 -r 3 -ngl 99 2>&1 | grep -E "pp512|error"
prof() { t=$1; shift; echo "== $*"; env "$@" timeout $t python3 -m vkengine.cli bench --model $f -p 512 -n 0 -r 2 --profile 2>&1 | sed -n '/^prefill/,$p' | grep -E "prefill|mul_mat|tok/s"; }
prof 200 VKENGINE_MC2_BK=64
prof 60 VKENGINE_MC2_BK=32
prof 60 VKENGINE_MC2_BK=64
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "mc2hk64" --tb=short > $OUT/kt.log 2>&1; tail -2 $OUT/kt.log
grep -E "^FAILED" $OUT/kt.log | head -8
