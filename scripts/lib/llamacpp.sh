# Shared by the scripts that run llama.cpp's llama-server beside ours (sourced; they set CACHE, SRC, PYTHON and
# CONVERT_PY first): the converter's environment and the conversion of a checkpoint to GGUF. NEVER RUN IN CI.

converter_venv() {
  # The converter imports torch, transformers and numpy (taken read-only from llmserve's environment
  # through a .pth, so only sentencepiece is downloaded) and sentencepiece (installed here).
  [[ -x $CONVERT_PY ]] && return
  "$PYTHON" -m venv "$CACHE/venv"
  local site; site=$("$CONVERT_PY" -c 'import site; print(site.getsitepackages()[0])')
  "$PYTHON" -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))' > "$site/llmserve-env.pth"
  "$CONVERT_PY" -m pip install -q sentencepiece
}

convert() {  # convert MODEL_DIR OUTTYPE FILE: skipped when FILE exists
  [[ -f $3 ]] && return
  # The converter names a BPE pre-tokenizer by hashing known models' tokenizations; our checkpoint's
  # toy tokenizer is not one of them, but its pre-tokenizer is GPT-2's ByteLevel regex: say so.
  PYTHONPATH=$SRC/gguf-py:$SRC "$CONVERT_PY" - "$SRC/convert_hf_to_gguf.py" "$1" "$2" "$3" <<'PY'
import runpy, sys
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
script, model, outtype, outfile = sys.argv[1:]
sys.argv = [script, model, "--outtype", outtype, "--outfile", outfile]
runpy.run_path(script, run_name="__main__")
PY
}
