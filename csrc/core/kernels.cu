// nvcc's view of the kernels: built into kernels.fatbin (every supported architecture plus PTX) at build
// time when nvcc is there, and embedded in the module. The host code never links against this object.
#include "kernels.cuh"
