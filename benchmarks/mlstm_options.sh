# Sourced by the retrofit scripts: mlstm_kwargs OPTION prints the mLSTM scorer_kwargs JSON of a run option,
# or fails (status 1) on an unknown one:
#   ""         {}                          (the defaults)
#   immediate  {"delayed": false}          (the readout right after absorbing the token, the paper's ablation)
#   fb<x>      {"forget_bias": x}          (the forget gate's initial bias, default 3)
#   tok        {"token_readout": true}     (the readout's term of the read token's own [k; v])
#   ds<n>      {"state_dim": n}            (the memory's feature size, default 32)
mlstm_kwargs() {
  case "$1" in
    "") echo '{}' ;;
    immediate) echo '{"delayed": false}' ;;
    fb*) echo "{\"forget_bias\": ${1#fb}}" ;;
    tok) echo '{"token_readout": true}' ;;
    ds*) echo "{\"state_dim\": ${1#ds}}" ;;
    *) return 1 ;;
  esac
}
