#!/usr/bin/env bash
# Builds the Austen + King James Bible corpus from Debian packages, with a fixed validation
# split, trains an 8192-token byte-level BPE on the training split, and writes token shards:
#   data/text/{train,val}/<document>.txt   one file per document (6 novels, 66 books)
#   data/text/tokenizer-8192.bpe
#   data/text/{train,val}.bin             uint16 token shards, <|endoftext|> after each document
# Validation = the last 5 % of lines of every document (same split on every run).
# Needs: bible-kjv, r-cran-janeaustenr (R, to read the novels), and a built build/mhla.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mhla=${MHLA:-$root/build/mhla}
out=$root/data/text
vocab=${VOCAB:-8192}

need=()
for p in bible-kjv r-cran-janeaustenr; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if ((${#need[@]})); then
  sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
[ -x "$mhla" ] || { echo "build mhla first (scripts/build.sh)" >&2; exit 1; }

raw=$(mktemp -d); trap 'rm -rf "$raw"' EXIT
Rscript -e 'library(janeaustenr); args <- commandArgs(TRUE);
  for (b in c("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey",
              "persuasion")) writeLines(get(b), file.path(args[1], paste0("austen-", b, ".txt")))' "$raw"
# The KJV, one verse per line without its reference, one file per book (in canonical order).
bible -f "gen1:1-rev22:21" | awk -v dir="$raw" '
  { ref = $1; book = ref; sub(/[0-9]+:[0-9]+$/, "", book)
    if (book != last) { n++; last = book; file = sprintf("%s/kjv-%02d-%s.txt", dir, n, book) }
    sub(/^[^ ]+ /, ""); print > file }'

rm -rf "$out/train" "$out/val"; mkdir -p "$out/train" "$out/val"
for f in "$raw"/*.txt; do
  name=$(basename "$f"); lines=$(wc -l < "$f"); keep=$(( lines - lines / 20 ))
  head -n "$keep" "$f" > "$out/train/$name"
  tail -n +"$((keep + 1))" "$f" > "$out/val/$name"
done
echo "documents: $(ls "$out/train" | wc -l); train $(cat "$out"/train/*.txt | wc -c) bytes, val $(cat "$out"/val/*.txt | wc -c) bytes"
"$mhla" tokenizer train --vocab "$vocab" --input "$out"/train/*.txt --output "$out/tokenizer-$vocab.bpe"
"$mhla" tokenizer shard --tokenizer "$out/tokenizer-$vocab.bpe" --input "$out"/train/*.txt --output "$out/train.bin"
"$mhla" tokenizer shard --tokenizer "$out/tokenizer-$vocab.bpe" --input "$out"/val/*.txt --output "$out/val.bin"
