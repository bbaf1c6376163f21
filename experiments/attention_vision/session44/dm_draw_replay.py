# Session 44: replays the random draws of the family test (tests/test_bidirectional_families.cpp,
# seed 21, the cases in the order of a MHLA_FAMILY_ERRORS=1 run: cases.txt holds "family dtype
# B= H= N= D= M=" per line) and, for the 1,200-token D = 32 cases, prints the float64 dm with row
# directions removed, its items' root-sum-square, and the error of a float64 model of the
# kernels' bf16 roundings (as session43/dm_rounding_emulation.py) on that very draw.
# The model rounds to bf16 in every case: its error on the Half cases means nothing; their
# conditioning (the ratio) does.
import os, sys
import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'session43'))
from dm_rounding_emulation import grads, perp  # the rounding model of session 43
torch.set_num_threads(2)
torch.manual_seed(21)
for idx,line in enumerate(open(sys.argv[1] if len(sys.argv) > 1 else 'call1_family_cases.txt'),1):
    fam,dt,B,H,N,D,M=line.split(); B,H,N,D,M=[int(x.split('=')[1]) for x in (B,H,N,D,M)]
    dtype=torch.bfloat16 if dt=='BFloat16' else torch.float16
    dims=(B,N,H,D)
    q=torch.randn(dims).to(dtype).double(); k=torch.randn(dims).to(dtype).double(); v=torch.randn(dims).to(dtype).double()
    g=torch.randn(dims).to(dtype).double()
    m=(torch.rand(M,M)+0.05).double() if M>1 else None
    if N==1200 and D==32:
        exact=grads(q,k,v,g,m,M,D,B,H,N//M,False); emu=grads(q,k,v,g,m,M,D,B,H,N//M,True)
        per=grads(q,k,v,g,m,M,D,B,H,N//M,False,per_item=True)
        pe=perp(exact,m); 
        # natural scale: root-sum-square over (batch, head) items of their own dm (row directions
        # removed); the ratio says how far the sum over items cancelled
        pi=torch.stack([perp(per[i],m) for i in range(per.shape[0])])
        scale=(pi.pow(2).sum(0).sum()).sqrt()
        print(idx,fam,dt,'|perp exact| %.4g'%pe.norm(), 'natural %.4g'%scale, 'ratio %.3f'%(pe.norm()/scale), 'emulated err %.4f'%((perp(emu,m)-pe).norm()/pe.norm()), flush=True)
