# call B (~9.5 min): #20 engine overhead for AttnRes cached (16 shuffled rounds); #27 balancing at 64 experts top-4
# (QB / aux-free x3 / aux loss, 2 seeds, 10 runs at once).
R=/tmp/rB; . .gpu/head.sh
TAILN=16 st engine 270 python3 scripts/bench/bench_engine_overhead.py --shape pipeline --steps 16 --variants attnres_cached --json $R/engine_attnres.json
TAILN=30 st study_bal 285 python3 -m k3train sweep configs/ablations/gpu/balancing.yaml --jobs 10 --out $R/study_bal
tar czf $OUT/rB.tgz -C /tmp --exclude=checkpoints rB; echo total $SECONDS
