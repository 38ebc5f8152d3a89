# Sourced by the retrofit scripts: mlstm_kwargs OPTION prints the mLSTM scorer_kwargs JSON of a run option,
# or fails (status 1) on an unknown one. Every option but tok keeps the paper's readout (token_readout false),
# which is what these scripts' runs trained before the trainer's default became token_readout true:
#   ""         {"token_readout": false}                      (the paper's mLSTM scorer)
#   immediate  {"delayed": false, "token_readout": false}    (the readout right after absorbing the token, the paper's ablation)
#   fb<x>      {"forget_bias": x, "token_readout": false}    (the forget gate's initial bias, default 3)
#   tok        {"token_readout": true}                       (the readout's term of the read token's own [k; v])
#   ds<n>      {"state_dim": n, "token_readout": false}      (the memory's feature size, default 32)
mlstm_kwargs() {
  case "$1" in
    "") echo '{"token_readout": false}' ;;
    immediate) echo '{"delayed": false, "token_readout": false}' ;;
    fb*) echo "{\"forget_bias\": ${1#fb}, \"token_readout\": false}" ;;
    tok) echo '{"token_readout": true}' ;;
    ds*) echo "{\"state_dim\": ${1#ds}, \"token_readout\": false}" ;;
    *) return 1 ;;
  esac
}
