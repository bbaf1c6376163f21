# Session 44: replays the random draws of the family test (tests/test_bidirectional_families.cpp,
# seed 21, the cases in the order of a MHLA_FAMILY_ERRORS=1 run: cases.txt holds "family dtype
# B= H= N= D= M=" per line) and, for the 1,200-token D = 32 cases, prints the float64 dm with row
# directions removed, its items' root-sum-square, and the error of a float64 model of the
# kernels' bf16 roundings (as session43/dm_rounding_emulation.py) on that very draw.
# The model rounds to bf16 in every case: its error on the Half cases means nothing; their
# conditioning (the ratio) does.
import torch, sys
torch.set_num_threads(2)
def phi(x):
    n = x * torch.rsqrt((x*x).mean(-1, keepdim=True) + 1e-6)
    return torch.relu(n) + 1e-6
def bf16(x): return x.to(torch.bfloat16).to(torch.float64)
def perp(gm,m): return gm - (gm*m).sum(1,keepdim=True)/(m*m).sum(1,keepdim=True)*m
def grads(q,k,v,g,m,M,D,B,H,L,rounded):
    r = bf16 if rounded else (lambda x: x)
    def blocks(x): return x.transpose(1,2).reshape(B*H,M,L,x.size(3))
    qf=blocks(phi(q)); kf=blocks(phi(k)); vb=blocks(v); gb=blocks(g)
    v1=torch.cat([vb,torch.ones(B*H,M,L,1,dtype=torch.float64)],-1)
    S=torch.einsum('bmld,bmle->bmde',r(kf),v1)
    Sm=torch.einsum('im,bmde->bide',m,S)
    Smr=Sm.clone(); Smr[...,:D]=r(Sm[...,:D])
    den=torch.einsum('bild,bid->bil',qf,Smr[...,D])[...,None]+1e-6
    dnum=r(gb/den)
    dphi=torch.einsum('bile,bide->bild',dnum,Smr[...,:D])
    g_dot_o=(r(qf)*dphi).sum(-1,keepdim=True)
    dden=r(-g_dot_o/den)
    dSm=torch.einsum('bild,bile->bide',r(qf),torch.cat([dnum,dden],-1))
    return torch.einsum('bide,bjde->ij',dSm,S), torch.einsum('bide,bjde->bij',dSm,S)
torch.manual_seed(21)
for idx,line in enumerate(open(sys.argv[1] if len(sys.argv) > 1 else 'call1_family_cases.txt'),1):
    fam,dt,B,H,N,D,M=line.split(); B,H,N,D,M=[int(x.split('=')[1]) for x in (B,H,N,D,M)]
    dtype=torch.bfloat16 if dt=='BFloat16' else torch.float16
    dims=(B,N,H,D)
    q=torch.randn(dims).to(dtype).double(); k=torch.randn(dims).to(dtype).double(); v=torch.randn(dims).to(dtype).double()
    g=torch.randn(dims).to(dtype).double()
    m=(torch.rand(M,M)+0.05).double() if M>1 else None
    if N==1200 and D==32:
        exact,per=grads(q,k,v,g,m,M,D,B,H,N//M,False); emu,_=grads(q,k,v,g,m,M,D,B,H,N//M,True)
        pe=perp(exact,m); 
        # natural scale: root-sum-square over (batch, head) items of their own dm (row directions
        # removed); the ratio says how far the sum over items cancelled
        pi=torch.stack([perp(per[i],m) for i in range(per.shape[0])])
        scale=(pi.pow(2).sum(0).sum()).sqrt()
        print(idx,fam,dt,'|perp exact| %.4g'%pe.norm(), 'natural %.4g'%scale, 'ratio %.3f'%(pe.norm()/scale), 'emulated err %.4f'%((perp(emu,m)-pe).norm()/pe.norm()), flush=True)
