# call C (what is left, ~7 min): #27 optimizer (AdamW / Muon per head / whole, 4 rates, 2 seeds) at 9 runs at once
# beside AttnRes vs standard (2 seeds) at 3.
R=/tmp/rC; . .gpu/head.sh
mkdir -p $R; (timeout $((BUDGET-40)) python3 -m k3train sweep configs/ablations/gpu/attnres.yaml --jobs 3 --out $R/study_attnres > $R/study_attnres.log 2>&1 &)
TAILN=40 st study_optim $((BUDGET-30)) python3 -m k3train sweep configs/ablations/gpu/optimizer.yaml --jobs 9 --out $R/study_optim
sleep 5; tail -30 $R/study_attnres.log | cut -c1-300
tar czf $OUT/rC.tgz -C /tmp --exclude=checkpoints rC; echo total $SECONDS
