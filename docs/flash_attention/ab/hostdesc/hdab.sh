# A/B: host-built descriptors (this tree) against in-kernel ones (d1a3d40), separate processes alternating
source .gpujob/env.sh
NEWDIR=$PWD
rm -rf /tmp/old && mkdir -p /tmp/old && git archive d1a3d40 | tar -x -C /tmp/old
M="--layout bshd --kernels --impls ours,sdpa_cudnn --shape 8,12,1024,64 --shape 8,25,1024,64 --shape 8,16,1000,64 --shape 4,16,2048,64 --shape 2,25,4096,64 --rounds 5"
L="--layout bhsd --kernels --impls ours,sdpa_cudnn --shape 1,16,16384,64 --shape 1,16,16384,128 --shape 4,32,4096,128 --shape 1,16,1024,64 --rounds 3"
for r in ${ROUNDS:-1 2}; do for t in old new; do
  D=$([ $t = old ] && echo /tmp/old || echo $NEWDIR)
  (cd $D && PYTHONPATH=$D:$D/cs336-basics timeout 200 python -m cs336_systems.benchmarking.flash_host_overhead $M --csv /tmp/logs/hd_${t}_m_$r.csv > /tmp/logs/hd_${t}_m_$r.txt 2>&1; echo "$t m $r rc=$?")
  (cd $D && PYTHONPATH=$D:$D/cs336-basics timeout 200 python -m cs336_systems.benchmarking.flash_host_overhead $L --csv /tmp/logs/hd_${t}_l_$r.csv > /tmp/logs/hd_${t}_l_$r.txt 2>&1; echo "$t l $r rc=$?")
done; done
pack > /dev/null
