"""Recreates the training corpus from Debian packages (apt-get download; nothing else).

  python3 prep_data.py [--out /work/train-data]

Writes OUT/debs/*.deb, OUT/x/<pkg>/ (unpacked), OUT/corpus/{train,heldout}.jsonl (one
{"source", "text"} document a line) and tools/train/data_manifest.json (package, version,
license, sha256 of the .deb and of every file read). Sources (see DATA.md for the licenses):

- bible-kjv-text: the King James Version (1611, public domain), decoded with bible-kjv's
  `bible` program (a tool only; its text is not used); one document per chapter.
- wordnet-base: WordNet 3.0 glosses and examples (WordNet 3.0 license, permissive), written as
  single-turn chat exchanges in the chat template's format ("What is a dog?" -> the gloss).
- python3.11-doc: the reStructuredText sources of the Python 3.11 documentation (PSF license
  2.0 / Zero-Clause BSD for the docs), prose paragraphs only (markup stripped, code dropped).

Every 50th document (by a stable hash) is held out. Deterministic: same packages, same bytes.
"""

import argparse
import glob
import hashlib
import json
import os
import re
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))

PACKAGES = {
    # name: (version, license, role)
    "bible-kjv-text": ("4.38", "public domain (KJV text, 1611); data file: 'unrestricted use ... copy, modify or "
                       "distribute this file at will' (Chip Chapin)", "data"),
    "bible-kjv": ("4.38", "GPL-2+ (program only, used to decode bible.data; not training data)", "tool"),
    "wordnet-base": ("1:3.0-37", "WordNet 3.0 license (permission to use, copy, modify and distribute for any "
                     "purpose, notice retained)", "data"),
    "python3.11-doc": ("3.11.2-6+deb12u9", "PSF-2.0 (Python documentation; docs examples also 0BSD)", "data"),
}

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def fetch(out):
    debs = os.path.join(out, "debs")
    os.makedirs(debs, exist_ok=True)
    info = {}
    for pkg, (ver, lic, role) in PACKAGES.items():
        have = glob.glob(os.path.join(debs, f"{pkg}_*.deb"))
        if not have:
            subprocess.run(["apt-get", "download", f"{pkg}={ver}"], cwd=debs, check=True)
            have = glob.glob(os.path.join(debs, f"{pkg}_*.deb"))
        deb = have[0]
        x = os.path.join(out, "x", pkg)
        if not os.path.isdir(x):
            os.makedirs(x)
            subprocess.run(["dpkg-deb", "-x", deb, x], check=True)
        real_ver = subprocess.run(["dpkg-deb", "-f", deb, "Version"], capture_output=True, text=True,
                                  check=True).stdout.strip()
        info[pkg] = {"package": pkg, "version": real_ver, "license": lic, "role": role,
                     "deb": os.path.basename(deb), "deb_sha256": sha256(deb), "files": {}}
    return info


def kjv(out, info):
    x = os.path.join(out, "x")
    data_dir = os.path.join(x, "bible-kjv-text", "usr", "lib")
    info["bible-kjv-text"]["files"]["usr/lib/bible.data"] = sha256(os.path.join(data_dir, "bible.data"))
    txt = subprocess.run([os.path.join(x, "bible-kjv", "usr", "bin", "bible"), "-l100000", "-p", data_dir,
                          "gen1:1-rev22:21"], capture_output=True, text=True, check=True).stdout
    docs = []
    cur = []
    for line in txt.split("\n"):
        m = re.match(r"^\s+\d+ (.*)$", line)
        if m:
            cur.append(m.group(1).strip())
        elif line.strip() and cur:
            docs.append(" ".join(cur))
            cur = []
    if cur:
        docs.append(" ".join(cur))
    return [("kjv", d) for d in docs]


def article(w):
    return "an" if w[0] in "aeiou" else "a"


def wordnet(out, info):
    base = os.path.join(out, "x", "wordnet-base", "usr", "share", "wordnet")
    docs = []
    for pos in ("noun", "verb", "adj", "adv"):
        path = os.path.join(base, f"data.{pos}")
        info["wordnet-base"]["files"][f"usr/share/wordnet/data.{pos}"] = sha256(path)
        with open(path, encoding="latin-1") as f:
            for n, line in enumerate(f):
                if line.startswith("  ") or "|" not in line:
                    continue
                head, gloss = line.split("|", 1)
                parts = head.split()
                wcnt = int(parts[3], 16)
                words = [parts[4 + 2 * i] for i in range(wcnt)]
                words = [re.sub(r"\(.*\)$", "", w).replace("_", " ") for w in words]
                defs, exs = [], []
                for piece in gloss.strip().split(";"):
                    piece = piece.strip()
                    if not piece:
                        continue
                    if piece.startswith('"'):
                        exs.append(piece.strip('"').strip())
                    else:
                        defs.append(piece)
                if not defs:
                    continue
                d = "; ".join(defs)
                for k, w in enumerate(words[:2]):
                    if not re.fullmatch(r"[a-z][a-z' -]*", w):
                        continue
                    variant = (n + k) % 3
                    if pos == "noun":
                        q = [f"What is {article(w)} {w}?", f"What does the word {w} mean?", f"Tell me about {w}."]
                        a = f"{article(w).capitalize()} {w} is {d}."
                    elif pos == "verb":
                        q = [f"What does it mean to {w}?", f"What does the verb {w} mean?", f"Define {w}."]
                        a = f"To {w} is to {d}."
                    else:
                        q = [f"What does {w} mean?", f"What does the word {w} mean?", f"Define {w}."]
                        a = f"{w.capitalize()} means {d}."
                    if exs:
                        a += f' For example: "{exs[0]}".'
                    docs.append(("wordnet", f"{USER}{q[variant]}{ASSISTANT}{a}"))
    return docs


ROLE = re.compile(r":[a-zA-Z:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")


def clean_rst(s):
    s = ROLE.sub(r"\1", s)
    s = re.sub(r"``([^`]*)``", r"\1", s)
    s = re.sub(r"`([^`<]*?)(?:\s*<[^>]*>)?`_*", r"\1", s)
    s = re.sub(r"\*\*([^*]+)\*\*", r"\1", s)
    s = re.sub(r"\*([^*\s][^*]*)\*", r"\1", s)
    s = re.sub(r"\|([^|]+)\|", r"\1", s)
    s = re.sub(r"\s+", " ", s).strip()
    s = s.replace(" ::", ".").replace("::", ":")
    return s


def pydoc(out, info):
    root = os.path.join(out, "x", "python3.11-doc", "usr", "share", "doc", "python3.11", "html", "_sources")
    docs = []
    for path in sorted(glob.glob(os.path.join(root, "**", "*.rst.txt"), recursive=True)):
        rel = os.path.relpath(path, os.path.join(out, "x", "python3.11-doc"))
        if "whatsnew/changelog" in rel or "/c-api/" in rel:
            continue
        info["python3.11-doc"]["files"][rel] = sha256(path)
        with open(path, encoding="utf-8") as f:
            paras = re.split(r"\n\s*\n", f.read())
        keep = []
        for p in paras:
            lines = p.split("\n")
            if not lines or lines[0].startswith((" ", "\t", "..", ">>>", "*", "-", "+", "=", "#", "|")):
                continue
            if any(re.fullmatch(r"[=\-~^\"'*#+]{3,}", l.strip()) for l in lines):
                continue
            t = clean_rst(p)
            letters = sum(ch.isalpha() or ch == " " for ch in t)
            if len(t) < 60 or letters < 0.85 * len(t) or not t[0].isupper() or t[-1] not in ".:":
                continue
            keep.append(t)
        if keep:
            docs.append(("python-docs", "\n\n".join(keep)))
    return docs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/work/train-data")
    args = ap.parse_args()
    info = fetch(args.out)
    docs = kjv(args.out, info) + wordnet(args.out, info) + pydoc(args.out, info)
    cdir = os.path.join(args.out, "corpus")
    os.makedirs(cdir, exist_ok=True)
    counts = {}
    with open(os.path.join(cdir, "train.jsonl"), "w") as tr, open(os.path.join(cdir, "heldout.jsonl"), "w") as ho:
        for src, text in docs:
            held = int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) % 50 == 0
            (ho if held else tr).write(json.dumps({"source": src, "text": text}, ensure_ascii=False) + "\n")
            c = counts.setdefault(src, {"docs": 0, "chars": 0, "heldout_docs": 0})
            c["docs"] += 1
            c["chars"] += len(text)
            c["heldout_docs"] += held
    manifest = {"generated_by": "tools/train/prep_data.py", "heldout_rule": "sha256(text)[:8] % 50 == 0",
                "sources": counts, "packages": list(info.values())}
    with open(os.path.join(HERE, "data_manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=False)
        f.write("\n")
    print(json.dumps(counts, indent=1))


if __name__ == "__main__":
    main()
