#!/usr/bin/env bash
# Make sure the offline Fashion-MNIST copy exists (the default backbone is pretrained on it).
# Debian/Ubuntu package `dataset-fashion-mnist` puts the idx files in /usr/share/datasets/fashion-mnist.
set -euo pipefail
dir=/usr/share/datasets/fashion-mnist
if [ -f "$dir/train-images-idx3-ubyte.gz" ] && [ -f "$dir/t10k-labels-idx1-ubyte.gz" ]; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing dataset-fashion-mnist (31 MB) with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null
elif command -v sudo >/dev/null && command -v apt-get >/dev/null; then
  sudo apt-get update -qq && sudo apt-get install -y -qq dataset-fashion-mnist >/dev/null
else
  echo "error: Fashion-MNIST not found in $dir. Install the Debian package dataset-fashion-mnist," >&2
  echo "or put {train,t10k}-{images-idx3,labels-idx1}-ubyte.gz in a folder and run" >&2
  echo "  .venv/bin/promptfcl pretrain --source fashion-mnist --set data-dir='\"FOLDER\"'" >&2
  exit 1
fi
