/* Symbol export for TensorFerry's public API (C and C++). The library is built with hidden
 * visibility; only declarations marked FERRY_API are part of its ABI. */
#ifndef FERRY_API_H_
#define FERRY_API_H_

#if defined(_WIN32)
#define FERRY_API
#else
#define FERRY_API __attribute__((visibility("default")))
#endif

#endif /* FERRY_API_H_ */
