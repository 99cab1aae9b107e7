"""The kimi_linear family (Kimi-Linear, Kimi K3) as plain PyTorch: no export, sharding or TVM code here.
The whole decoder is `k3compile.model.k3.K3ForCausalLM`."""
