# call 2: mul_mc2 variants, one process per kind (a crash names its kind)
for k in mc2h_128x256 mc2h_256x256 mc2h_128x128 mc2h_256x128 mc2h_64x128 mc2h_64x256 mc2h_128x64 mc2h_128x256s1 mc2h_128x256s2 mc2h_128x256k64 mc2h_128x256k64s2 mc2h_128x256k64u8s2 mc2h_128x256k64s1 mc2h_256x256s2 mc2h_256x256k64s2 mc2h_64x256s2 mc2h_64x256k64s2; do
  timeout 40 python3 bench/mm_probe.py --types q4_0 --kinds $k -n 512 --runs 4 --out $OUT/mm-$k.json > $OUT/mm-$k.log 2>&1; rc=$?
  grep -E "TFLOPS|FAILED" $OUT/mm-$k.log; [ $rc = 0 ] || { echo "$k rc=$rc"; tail -5 $OUT/mm-$k.log; }
done
