# Emulation of the MHLA kernels' bf16 roundings for dm (session 43): phi(k), phi(q) in bf16 tiles,
# S' read as bf16, dnum = dO / den in bf16, dO . o from bf16 products, dden in bf16.
import torch, sys
def phi(x):
    n = x * torch.rsqrt((x*x).mean(-1, keepdim=True) + 1e-6)
    return torch.relu(n) + 1e-6
def bf16(x): return x.to(torch.bfloat16).to(torch.float64)
def perp(gm,m): return gm - (gm*m).sum(1,keepdim=True)/(m*m).sum(1,keepdim=True)*m
def grads(q,k,v,g,m,M,D,B,H,L,rounded,per_item=False):
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
    if per_item:  # dm of each (batch, head) item (session 44's draw replay)
        return torch.einsum('bide,bjde->bij',dSm,S)
    return torch.einsum('bide,bjde->ij',dSm,S)
def run(B,H,N,D,M,seed):
    torch.manual_seed(seed)
    q,k,v,g = [bf16(torch.randn(B,N,H,D,dtype=torch.float64)) for _ in range(4)]
    m = torch.rand(M,M,dtype=torch.float64)+0.05
    L=N//M
    exact=grads(q,k,v,g,m,M,D,B,H,L,False); got=grads(q,k,v,g,m,M,D,B,H,L,True)
    return ((perp(got,m)-perp(exact,m)).norm()/perp(exact,m).norm()).item()
if __name__ == '__main__':
    shape=tuple(int(x) for x in sys.argv[1:6]); n=int(sys.argv[6])
    e=sorted(run(*shape,s) for s in range(n))
    print(shape, 'median %.4f max %.4f' % (e[len(e)//2], e[-1]), ' '.join('%.4f'%x for x in e[-5:]))
