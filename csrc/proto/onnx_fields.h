// Field numbers of onnx.proto (ONNX IR version 11) used by the reader and the writer.
#pragma once

#include <cstdint>

namespace fastopt::field {

namespace model {
constexpr uint32_t kIrVersion = 1, kProducerName = 2, kProducerVersion = 3, kDomain = 4,
                   kModelVersion = 5, kDocString = 6, kGraph = 7, kOpsetImport = 8,
                   kMetadataProps = 14, kFunctions = 25;
}
namespace opset {
constexpr uint32_t kDomain = 1, kVersion = 2;
}
namespace entry {  // StringStringEntryProto
constexpr uint32_t kKey = 1, kValue = 2;
}
namespace graph {
constexpr uint32_t kNode = 1, kName = 2, kInitializer = 5, kInput = 11, kOutput = 12,
                   kValueInfo = 13, kSparseInitializer = 15;
}
namespace node {
constexpr uint32_t kInput = 1, kOutput = 2, kName = 3, kOpType = 4, kAttribute = 5, kDomain = 7,
                   kOverload = 8;
}
namespace attr {
constexpr uint32_t kName = 1, kF = 2, kI = 3, kS = 4, kT = 5, kG = 6, kFloats = 7, kInts = 8,
                   kStrings = 9, kTensors = 10, kGraphs = 11, kType = 20, kRefAttrName = 21;
}
namespace value_info {
constexpr uint32_t kName = 1, kType = 2;
}
namespace type {
constexpr uint32_t kTensorType = 1;
namespace tensor {
constexpr uint32_t kElemType = 1, kShape = 2;
}
namespace shape {
constexpr uint32_t kDim = 1;
}
namespace dim {
constexpr uint32_t kValue = 1, kParam = 2;
}
}  // namespace type
namespace tensor {
constexpr uint32_t kDims = 1, kDataType = 2, kFloatData = 4, kInt32Data = 5, kStringData = 6,
                   kInt64Data = 7, kName = 8, kRawData = 9, kDoubleData = 10, kUint64Data = 11,
                   kExternalData = 13, kDataLocation = 14;
constexpr int32_t kLocationDefault = 0, kLocationExternal = 1;
}  // namespace tensor
namespace sparse {
constexpr uint32_t kValues = 1, kIndices = 2, kDims = 3;
}
namespace function {
constexpr uint32_t kName = 1, kInput = 4, kOutput = 5, kAttribute = 6, kNode = 7, kOpsetImport = 9,
                   kDomain = 10, kAttributeProto = 11, kValueInfo = 12, kOverload = 13;
}

}  // namespace fastopt::field
