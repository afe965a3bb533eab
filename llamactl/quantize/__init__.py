"""The offline quantization stage.

options  QuantOptions and the layers a method quantizes
stage    quantize(): validation, the method's writer, the quality report, the manifest
formats  one object per checkpoint format (GPTQ, bitsandbytes): write it, swap its modules at
         load, the kernels that accelerate it; looked up by quant_method
rtn      llamactl's round-to-nearest writer (GPTQ format)
gptq     GPTQModel's writer (GPTQ format)
bnb      bitsandbytes' writer (NF4, LLM.int8)
"""
