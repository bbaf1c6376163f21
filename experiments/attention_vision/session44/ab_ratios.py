import json,glob,sys,os
d=sys.argv[1] if len(sys.argv)>1 else '.'
peer={}
for l in open(os.path.join(d,'peers_vision.jsonl')):
    if l.startswith('{'):
        x=json.loads(l)
        if x.get('kind')=='vision': peer[(x['op'],x['N'])]=x['fwdbwd_ms']
for s in sorted({os.path.basename(f).split('_')[1] for f in glob.glob(os.path.join(d,'vision_s*_r*_mhla.jsonl'))}):
    for op in ['mhla','linear']:
        rows={}
        for f in sorted(glob.glob(os.path.join(d,f'vision_{s}_r*_{op}.jsonl'))):
            for l in open(f):
                if l.startswith('{'):
                    x=json.loads(l); rows.setdefault(x['N'],[]).append((x['fwd_bwd_ms'],x['fwd_bwd_bandwidth_share']))
        for N in sorted(rows):
            ms=[r[0] for r in rows[N]]; sh=[r[1] for r in rows[N]]
            extra=''
            if op=='mhla':
                p=peer[('mhla_torch_M16',N)]; c=peer[('sdpa_cudnn',N)]
                extra=f" torch {p:.3f} -> {p/max(ms):.1f}-{p/min(ms):.1f}x  cudnn {c:.3f} -> {c/max(ms):.2f}-{c/min(ms):.2f}x"
            print(s,op,N,' '.join(f'{m:.4f}' for m in ms),' share',' '.join(f'{100*v:.1f}' for v in sh),extra)
