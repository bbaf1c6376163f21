import torch
def phi(x):
    n = x * torch.rsqrt((x*x).mean(-1, keepdim=True) + 1e-6)
    return torch.relu(n) + 1e-6
def bf16(x): return x.to(torch.bfloat16).to(torch.float64)
def perp(gm,m): return gm - (gm*m).sum(1,keepdim=True)/(m*m).sum(1,keepdim=True)*m
def run(B,H,N,D,M,seed):
    torch.manual_seed(seed)
    q,k,v,g = [bf16(torch.randn(B,N,H,D,dtype=torch.float64)) for _ in range(4)]
    m = torch.rand(M,M,dtype=torch.float64)+0.05
    L=N//M
    def blocks(x): return x.transpose(1,2).reshape(B*H,M,L,x.size(3))
    qf=blocks(phi(q)); kf=blocks(phi(k)); vb=blocks(v); gb=blocks(g)
    v1=torch.cat([vb,torch.ones(B*H,M,L,1,dtype=torch.float64)],-1)
    S=torch.einsum('bmld,bmle->bmde',kf,v1)            # [BH,M,D,D+1]
    Sm=torch.einsum('im,bmde->bide',m,S)
    out=torch.einsum('bild,bide->bile',qf,Sm)
    den=out[...,D:]+1e-6
    o=out[...,:D]/den
    dnum=gb/den
    dden=-(gb*o).sum(-1,keepdim=True)/den
    def dm_of(qf_, dnum_, dden_):
        dSm=torch.einsum('bild,bile->bide',qf_,torch.cat([dnum_,dden_],-1))  # dS'_i
        return torch.einsum('bide,bjde->ij',dSm,S), torch.einsum('bide,bjde->ij',dSm[...,:D],S[...,:D])
    exact, s_part = dm_of(qf,dnum,dden)
    rounded,_ = dm_of(bf16(qf),bf16(dnum),bf16(dden))
    e=(perp(rounded,m)-perp(exact,m)).norm()/perp(exact,m).norm()
    return e.item(), (s_part.norm()/perp(exact,m).norm()).item()
for shape in []:
    r=[run(*shape,s) for s in range(4)]
    print(shape, 'rel err of perp dm with bf16 phi(q), dnum, dden:', ' '.join('%.4f'%a for a,_ in r), '| S-part/|dm|:', ' '.join('%.0f'%b for _,b in r))
print('tail:', sorted(['%.4f'%run(16,8,1200,32,2,s)[0] for s in range(10,34)]))
