# call A (~9.5 min): #22 first step (GIL-safe stack sampler), fp8 at the slice through the compiled float8 products
# (profiled); #20 timing model with chunks of 4 layers split by FLOPs.
R=/tmp/rA; . .gpu/head.sh
TAILN=14 st first_step 155 python3 scripts/bench/bench_first_step.py --timeout 150 --stacks 30 --json $R/first_step.json
TAILN=60 st fp8_slice 250 python3 scripts/bench/bench_fp8.py --preset slice --recipes bf16 fp8 --steps 10 --warmup 3 --profile 15 --out $R/fp8_slice
TAILN=40 st predict 150 python3 scripts/bench/predict_pipeline.py --layers-per-chunk 4 --json $R/predict.json
echo total $SECONDS
