/*
 * fakenvml.c: a fake libnvidia-ml.so.1 that serves the NVML C ABI from a flat
 * `key = value` state file, for GPU-free tests of pynvml-based tools.
 *
 * Struct layouts are written from the public ctypes definitions in pynvml.py
 * (nvidia-ml-py); NVIDIA's nvml.h is not used. README.md documents the state
 * keys, the exported symbols and the semantics kept from the real driver.
 *
 * Concurrency: ctypes releases the GIL around foreign calls, so every entry
 * point takes one mutex; injected delays sleep after it is released so that a
 * slow GPU does not stall calls to the others.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---------------------------------------------------------------- ABI types */

typedef int nvmlReturn_t;
typedef struct fake_handle *nvmlDevice_t;
typedef struct fake_event_set *nvmlEventSet_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

typedef struct {
    unsigned long long bar1Total;
    unsigned long long bar1Free;
    unsigned long long bar1Used;
} nvmlBAR1Memory_t;

/* unversioned process list entry (nvitop's c_nvmlProcessInfo_v1_t) */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

/* _v2 and _v3 process list entry: one layout (c_nvmlProcessInfo_v3_t) */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
    unsigned long long usedGpuCcProtectedMemory;
} nvmlProcessDetail_v1_t;

typedef struct {
    unsigned int version;
    unsigned int mode;
    unsigned int numProcArrayEntries;
    nvmlProcessDetail_v1_t *procArray;
} nvmlProcessDetailList_v1_t;

typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil;
    unsigned int memUtil;
    unsigned int encUtil;
    unsigned int decUtil;
} nvmlProcessUtilizationSample_t;

typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    signed long long sllVal;
    signed int siVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    unsigned long long timeStamp;
    nvmlValue_t sampleValue;
} nvmlSample_t;

typedef struct {
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;
    long long latencyUsec;
    unsigned int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

typedef struct {
    unsigned long long protectedMemSizeKib;
    unsigned long long unprotectedMemSizeKib;
} nvmlConfComputeMemSizeInfo_t;

typedef struct {
    unsigned int version;
    unsigned int sensorType;
    int temperature;
} nvmlTemperature_v1_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

/* what nvmlEventSetWait (no suffix) fills: the layout from before MIG added
 * the instance ids, which is a prefix of nvmlEventData_t */
typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
} nvmlEventData_legacy_t;

/* sizes pynvml's ctypes definitions assume on LP64 */
_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t");
_Static_assert(sizeof(nvmlUtilization_t) == 8, "nvmlUtilization_t");
_Static_assert(sizeof(nvmlMemory_t) == 24, "nvmlMemory_t");
_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t");
_Static_assert(sizeof(nvmlBAR1Memory_t) == 24, "nvmlBAR1Memory_t");
_Static_assert(sizeof(nvmlProcessInfo_v1_t) == 16, "nvmlProcessInfo_v1_t");
_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t");
_Static_assert(sizeof(nvmlProcessDetail_v1_t) == 32, "nvmlProcessDetail_v1_t");
_Static_assert(sizeof(nvmlProcessDetailList_v1_t) == 24, "nvmlProcessDetailList_v1_t");
_Static_assert(sizeof(nvmlProcessUtilizationSample_t) == 32, "nvmlProcessUtilizationSample_t");
_Static_assert(sizeof(nvmlValue_t) == 8, "nvmlValue_t");
_Static_assert(sizeof(nvmlSample_t) == 16, "nvmlSample_t");
_Static_assert(sizeof(nvmlFieldValue_t) == 40, "nvmlFieldValue_t");
_Static_assert(sizeof(nvmlConfComputeMemSizeInfo_t) == 16, "nvmlConfComputeMemSizeInfo_t");
_Static_assert(sizeof(nvmlTemperature_v1_t) == 12, "nvmlTemperature_v1_t");
_Static_assert(sizeof(nvmlEventData_t) == 32, "nvmlEventData_t");
_Static_assert(sizeof(nvmlEventData_legacy_t) == 24, "nvmlEventData_legacy_t");

/* NVML versions a struct as its size plus the version number in the top byte */
#define STRUCT_VERSION(type, v) ((unsigned int)(sizeof(type) | ((v) << 24)))
#define MEMORY_V2 STRUCT_VERSION(nvmlMemory_v2_t, 2)
#define TEMPERATURE_V1 STRUCT_VERSION(nvmlTemperature_v1_t, 1)
#define PROCESS_DETAIL_LIST_V1 STRUCT_VERSION(nvmlProcessDetailList_v1_t, 1)
_Static_assert(MEMORY_V2 == 0x02000028u, "nvmlMemory_v2");
_Static_assert(TEMPERATURE_V1 == 0x0100000Cu, "nvmlTemperature_v1");
_Static_assert(PROCESS_DETAIL_LIST_V1 == 0x01000018u, "nvmlProcessDetailList_v1");

#define VALUE_TYPE_DOUBLE 0u
#define VALUE_TYPE_UNSIGNED_INT 1u
#define VALUE_TYPE_UNSIGNED_LONG_LONG 3u
#define VALUE_TYPE_SIGNED_LONG_LONG 4u
#define EVENT_TYPE_XID 0x8ull
#define NOT_AVAILABLE_U32 0xFFFFFFFFu
#define NOT_AVAILABLE_U64 0xFFFFFFFFFFFFFFFFull

/* ------------------------------------------------------- exported functions */

/* Every NVML entry point, in README order. The list numbers the call counters
 * and the err.<function> keys; build.py's EXPORTED_SYMBOLS mirrors it. */
#define FAKE_NVML_FUNCTIONS(X)                                                  \
    X(nvmlInit) X(nvmlInit_v2) X(nvmlInitWithFlags) X(nvmlShutdown)             \
    X(nvmlErrorString)                                                          \
    X(nvmlSystemGetDriverVersion) X(nvmlSystemGetNVMLVersion)                   \
    X(nvmlSystemGetCudaDriverVersion) X(nvmlSystemGetCudaDriverVersion_v2)      \
    X(nvmlSystemGetProcessName)                                                 \
    X(nvmlDeviceGetCount) X(nvmlDeviceGetCount_v2)                              \
    X(nvmlDeviceGetHandleByIndex) X(nvmlDeviceGetHandleByIndex_v2)              \
    X(nvmlDeviceGetHandleByUUID)                                                \
    X(nvmlDeviceGetHandleByPciBusId) X(nvmlDeviceGetHandleByPciBusId_v2)        \
    X(nvmlDeviceGetIndex) X(nvmlDeviceGetMinorNumber)                           \
    X(nvmlDeviceGetName) X(nvmlDeviceGetUUID) X(nvmlDeviceGetSerial)            \
    X(nvmlDeviceGetPciInfo_v3) X(nvmlDeviceGetBrand)                            \
    X(nvmlDeviceGetArchitecture) X(nvmlDeviceGetCudaComputeCapability)          \
    X(nvmlDeviceGetVbiosVersion)                                                \
    X(nvmlDeviceGetUtilizationRates) X(nvmlDeviceGetEncoderUtilization)         \
    X(nvmlDeviceGetDecoderUtilization)                                          \
    X(nvmlDeviceGetMemoryInfo) X(nvmlDeviceGetMemoryInfo_v2)                    \
    X(nvmlDeviceGetBAR1MemoryInfo)                                              \
    X(nvmlDeviceGetTemperature) X(nvmlDeviceGetTemperatureV)                    \
    X(nvmlDeviceGetTemperatureThreshold)                                        \
    X(nvmlDeviceGetPowerUsage) X(nvmlDeviceGetEnforcedPowerLimit)               \
    X(nvmlDeviceGetPowerManagementLimit)                                        \
    X(nvmlDeviceGetPowerManagementDefaultLimit)                                 \
    X(nvmlDeviceGetPowerManagementLimitConstraints)                             \
    X(nvmlDeviceGetTotalEnergyConsumption)                                      \
    X(nvmlDeviceGetClockInfo) X(nvmlDeviceGetMaxClockInfo)                      \
    X(nvmlDeviceGetCurrentClocksThrottleReasons)                                \
    X(nvmlDeviceGetCurrentClocksEventReasons)                                   \
    X(nvmlDeviceGetPcieThroughput) X(nvmlDeviceGetPcieReplayCounter)            \
    X(nvmlDeviceGetCurrPcieLinkGeneration) X(nvmlDeviceGetCurrPcieLinkWidth)    \
    X(nvmlDeviceGetMaxPcieLinkGeneration) X(nvmlDeviceGetMaxPcieLinkWidth)      \
    X(nvmlDeviceGetFanSpeed) X(nvmlDeviceGetFanSpeed_v2) X(nvmlDeviceGetNumFans) \
    X(nvmlDeviceGetPerformanceState) X(nvmlDeviceGetPersistenceMode)            \
    X(nvmlDeviceGetDisplayActive) X(nvmlDeviceGetDisplayMode)                   \
    X(nvmlDeviceGetComputeMode)                                                 \
    X(nvmlDeviceGetTotalEccErrors) X(nvmlDeviceGetRemappedRows)                 \
    X(nvmlDeviceGetComputeRunningProcesses)                                     \
    X(nvmlDeviceGetComputeRunningProcesses_v2)                                  \
    X(nvmlDeviceGetComputeRunningProcesses_v3)                                  \
    X(nvmlDeviceGetGraphicsRunningProcesses)                                    \
    X(nvmlDeviceGetGraphicsRunningProcesses_v2)                                 \
    X(nvmlDeviceGetGraphicsRunningProcesses_v3)                                 \
    X(nvmlDeviceGetMPSComputeRunningProcesses)                                  \
    X(nvmlDeviceGetMPSComputeRunningProcesses_v2)                               \
    X(nvmlDeviceGetMPSComputeRunningProcesses_v3)                               \
    X(nvmlDeviceGetRunningProcessDetailList) X(nvmlDeviceGetProcessUtilization) \
    X(nvmlDeviceGetSamples) X(nvmlDeviceGetFieldValues)                         \
    X(nvmlDeviceGetDriverModel) X(nvmlDeviceGetDriverModel_v2)                  \
    X(nvmlDeviceIsMigDeviceHandle) X(nvmlDeviceGetMigMode)                      \
    X(nvmlDeviceGetConfComputeMemSizeInfo)                                      \
    X(nvmlEventSetCreate) X(nvmlDeviceRegisterEvents)                           \
    X(nvmlDeviceGetSupportedEventTypes) X(nvmlEventSetWait)                     \
    X(nvmlEventSetWait_v2) X(nvmlEventSetFree)

#define AS_ENUM(name) FN_##name,
#define AS_NAME(name) #name,
enum fn_id { FAKE_NVML_FUNCTIONS(AS_ENUM) FN_COUNT };
static const char *const fn_names[FN_COUNT] = {FAKE_NVML_FUNCTIONS(AS_NAME)};

static unsigned long long g_calls[FN_COUNT];

static void count_call(enum fn_id fn)
{
    __atomic_add_fetch(&g_calls[fn], 1, __ATOMIC_RELAXED);
}

static int fn_lookup(const char *name)
{
    for (int i = 0; i < FN_COUNT; i++)
        if (strcmp(fn_names[i], name) == 0)
            return i;
    return -1;
}

/* ------------------------------------------------------------- error codes */

struct error_code {
    const char *name;
    nvmlReturn_t code;
    const char *text;
};

/* names follow pynvml's NVML_ERROR_* constants, texts its NVMLError table */
static const struct error_code error_codes[] = {
    {"SUCCESS", 0, "Success"},
    {"UNINITIALIZED", 1, "Uninitialized"},
    {"INVALID_ARGUMENT", 2, "Invalid Argument"},
    {"NOT_SUPPORTED", 3, "Not Supported"},
    {"NO_PERMISSION", 4, "Insufficient Permissions"},
    {"ALREADY_INITIALIZED", 5, "Already Initialized"},
    {"NOT_FOUND", 6, "Not Found"},
    {"INSUFFICIENT_SIZE", 7, "Insufficient Size"},
    {"INSUFFICIENT_POWER", 8, "Insufficient External Power"},
    {"DRIVER_NOT_LOADED", 9, "Driver Not Loaded"},
    {"TIMEOUT", 10, "Timeout"},
    {"IRQ_ISSUE", 11, "Interrupt Request Issue"},
    {"LIBRARY_NOT_FOUND", 12, "NVML Shared Library Not Found"},
    {"FUNCTION_NOT_FOUND", 13, "Function Not Found"},
    {"CORRUPTED_INFOROM", 14, "Corrupted infoROM"},
    {"GPU_IS_LOST", 15, "GPU is lost"},
    {"RESET_REQUIRED", 16, "GPU requires restart"},
    {"OPERATING_SYSTEM", 17, "The operating system has blocked the request."},
    {"LIB_RM_VERSION_MISMATCH", 18, "RM has detected an NVML/RM version mismatch."},
    {"IN_USE", 19, "In use by another client"},
    {"MEMORY", 20, "Insufficient Memory"},
    {"NO_DATA", 21, "No data"},
    {"VGPU_ECC_NOT_SUPPORTED", 22, "vGPU ECC not supported"},
    {"INSUFFICIENT_RESOURCES", 23, "Insufficient resources"},
    {"FREQ_NOT_SUPPORTED", 24, "Frequency not supported"},
    {"ARGUMENT_VERSION_MISMATCH", 25, "Argument version mismatch"},
    {"DEPRECATED", 26, "Deprecated"},
    {"NOT_READY", 27, "Not ready"},
    {"GPU_NOT_FOUND", 28, "GPU not found"},
    {"INVALID_STATE", 29, "Invalid state"},
    {"RESET_TYPE_NOT_SUPPORTED", 30, "Reset type not supported"},
    {"UNKNOWN", 999, "Unknown Error"},
};
#define N_ERROR_CODES (sizeof(error_codes) / sizeof(error_codes[0]))

/* ------------------------------------------------------------------- state */

#define MAX_DEVICES 64
#define MAX_PROCS 64
#define MAX_XIDS 256
#define MAX_FIELDS 64
#define STR_LEN 96
#define VERSION_LEN 80
#define UNSET_U32 0xFFFFFFFFu

enum proc_kind { PROCS_COMPUTE, PROCS_GRAPHICS, PROCS_MPS, PROC_KINDS };
enum { CLOCK_GRAPHICS, CLOCK_SM, CLOCK_MEM, CLOCK_VIDEO, CLOCK_COUNT };

struct proc_entry {
    unsigned int pid;
    unsigned long long used;
};

struct proc_util {
    unsigned int pid, sm, mem, enc, dec;
};

struct field_entry {
    unsigned int id;
    unsigned int scope;
    bool any_scope;
    nvmlReturn_t ret;
    unsigned int type;
    nvmlValue_t value;
};

/* One device as the state file describes it. Scalars come first so that a
 * reparse copies the defaults with one memcpy up to `n_procs`; the lists
 * after it are only valid up to their counts. */
struct dev_state {
    char name[STR_LEN], uuid[STR_LEN], serial[STR_LEN], bus_id[32], vbios[32];
    unsigned int pci_domain, pci_bus, pci_dev, pci_fn;
    unsigned int pci_device_id, pci_subsystem_id, minor, brand, arch, cc_major, cc_minor;
    unsigned int lost;
    unsigned int util_gpu, util_mem, util_enc, util_dec;
    unsigned long long mem_total, mem_used, mem_reserved, bar1_total, bar1_used;
    unsigned int temp, temp_slowdown, temp_shutdown;
    unsigned int power_usage, power_limit, power_mgmt_limit, power_default_limit;
    unsigned int power_min_limit, power_max_limit;
    unsigned long long energy;
    unsigned int clock[CLOCK_COUNT], clock_max[CLOCK_COUNT];
    unsigned long long throttle;
    unsigned int pcie_tx, pcie_rx, pcie_replay, link_gen, link_width, max_link_gen, max_link_width;
    unsigned int fan_speed, fan_count;
    unsigned int pstate, persistence, display_active, display_mode, compute_mode;
    unsigned int ecc_supported;
    unsigned long long ecc[2][2]; /* [corrected, uncorrected][volatile, aggregate] */
    unsigned int has_remapped, remapped[4];
    unsigned int sample_period_us;
    int delay_us; /* -1: the global delay_us applies */
    nvmlReturn_t err[FN_COUNT];
    unsigned int n_procs[PROC_KINDS];
    unsigned int n_util, n_xid, n_fields;
    struct proc_entry procs[PROC_KINDS][MAX_PROCS];
    struct proc_util util[MAX_PROCS];
    unsigned int xid[MAX_XIDS];
    struct field_entry fields[MAX_FIELDS];
};

struct fake_state {
    unsigned int device_count;
    char driver_version[VERSION_LEN], nvml_version[VERSION_LEN];
    int cuda_driver_version;
    unsigned int delay_us;
    nvmlReturn_t err[FN_COUNT];
    struct dev_state dev[MAX_DEVICES];
};

/* The fake's handles are pointers into this array; anything else is foreign. */
struct fake_handle {
    unsigned int index;
};

struct fake_event_set {
    struct fake_event_set *next;
    unsigned long long types[MAX_DEVICES];
    unsigned int delivered[MAX_DEVICES];
};

/* Utilization and clock history for nvmlDeviceGetSamples: one ring of grid
 * points per device, every sampling type sharing the timestamps. */
#define RING_LEN 120
enum { N_SAMPLE_TYPES = 7 }; /* TOTAL_POWER .. MEMORY_CLK */

struct history {
    unsigned long long next_ts; /* next grid point to fill, µs CLOCK_REALTIME */
    unsigned int head, n;
    unsigned long long ts[RING_LEN];
    unsigned int val[N_SAMPLE_TYPES][RING_LEN];
};

struct file_id {
    dev_t dev;
    ino_t ino;
    off_t size;
    long long mtime_ns, ctime_ns;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct fake_state g_states[2];
static struct fake_state *g_cur = &g_states[0];
static struct fake_state *g_spare = &g_states[1];
static struct fake_handle g_handles[MAX_DEVICES];
static struct history g_hist[MAX_DEVICES];
static struct fake_event_set *g_sets;
static unsigned int g_refcount;
static char g_path[PATH_MAX];
static struct file_id g_file;
static unsigned long long g_reload_interval_us;
static unsigned long long g_last_check_us;
static unsigned long long g_grid_t0;
static char *g_text;
static size_t g_text_cap;

/* -------------------------------------------------------------- utilities */

static unsigned long long clock_us(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (unsigned long long)ts.tv_sec * 1000000ull + (unsigned long long)ts.tv_nsec / 1000ull;
}

static unsigned long long now_us(void)
{
    return clock_us(CLOCK_REALTIME);
}

static void sleep_us(unsigned long long us)
{
    struct timespec ts = {.tv_sec = (time_t)(us / 1000000ull),
                          .tv_nsec = (long)(us % 1000000ull) * 1000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

static char *trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    char *end = s + strlen(s);
    while (end > s && isspace((unsigned char)end[-1]))
        *--end = '\0';
    return s;
}

/* Warnings go to stderr once per distinct text: a simulator rewrites the same
 * typo many times a second. Called with g_lock held. */
#define MAX_WARNINGS 256
static char *g_warned[MAX_WARNINGS];
static unsigned int g_n_warned;

static void warn_once(const char *text)
{
    for (unsigned int i = 0; i < g_n_warned; i++)
        if (strcmp(g_warned[i], text) == 0)
            return;
    if (g_n_warned < MAX_WARNINGS) {
        char *copy = strdup(text);
        if (copy)
            g_warned[g_n_warned++] = copy;
    }
    fprintf(stderr, "fake-nvml: %s\n", text);
}

static void warn_unknown(const char *key)
{
    char text[512];
    snprintf(text, sizeof text, "unknown state key '%s'", key);
    warn_once(text);
}

static void warn_value(const char *key, const char *value)
{
    char text[512];
    snprintf(text, sizeof text, "bad value for state key '%s': '%s'", key, value);
    warn_once(text);
}

/* Integers accept decimal, 0x hex, and decimals rounded to the nearest integer
 * (a simulator computing floats should not have to round). */
static bool parse_u64(const char *s, unsigned long long *out)
{
    if (*s == '\0' || *s == '-')
        return false;
    char *end;
    errno = 0;
    bool hex = s[0] == '0' && (s[1] == 'x' || s[1] == 'X');
    unsigned long long v = strtoull(s, &end, hex ? 16 : 10);
    if (*end == '\0' && errno == 0) {
        *out = v;
        return true;
    }
    if (hex)
        return false;
    double d = strtod(s, &end);
    if (*end != '\0' || !(d >= 0 && d < 1.8e19)) /* also rejects NaN and inf */
        return false;
    *out = (unsigned long long)(d + 0.5);
    return true;
}

static bool parse_u32(const char *s, unsigned int *out)
{
    unsigned long long v;
    if (!parse_u64(s, &v) || v > UINT_MAX)
        return false;
    *out = (unsigned int)v;
    return true;
}

static bool parse_bool(const char *s, unsigned int *out)
{
    if (strcasecmp(s, "true") == 0 || strcasecmp(s, "yes") == 0) {
        *out = 1;
        return true;
    }
    if (strcasecmp(s, "false") == 0 || strcasecmp(s, "no") == 0) {
        *out = 0;
        return true;
    }
    unsigned int v;
    if (!parse_u32(s, &v) || v > 1)
        return false;
    *out = v;
    return true;
}

/* NAME, NVML_ERROR_NAME or a number */
static bool parse_error(const char *s, nvmlReturn_t *out)
{
    if (strncasecmp(s, "NVML_ERROR_", 11) == 0)
        s += 11;
    for (size_t i = 0; i < N_ERROR_CODES; i++) {
        if (strcasecmp(s, error_codes[i].name) == 0) {
            *out = error_codes[i].code;
            return true;
        }
    }
    unsigned int v;
    if (!parse_u32(s, &v))
        return false;
    *out = (nvmlReturn_t)v;
    return true;
}

static bool parse_string(const char *s, char *dst, size_t size)
{
    size_t len = strlen(s);
    if (len >= size)
        return false;
    memcpy(dst, s, len + 1);
    return true;
}

/* "domain:bus:device.function" or "bus:device.function", hex */
static bool parse_bus_id(const char *s, unsigned int out[4])
{
    unsigned int dom = 0, bus, dev, fn;
    char tail;
    if (sscanf(s, "%x:%x:%x.%x%c", &dom, &bus, &dev, &fn, &tail) == 4 ||
        (dom = 0, sscanf(s, "%x:%x.%x%c", &bus, &dev, &fn, &tail) == 3)) {
        if (bus > 0xFF || dev > 0x1F || fn > 0x7)
            return false;
        out[0] = dom, out[1] = bus, out[2] = dev, out[3] = fn;
        return true;
    }
    return false;
}

/* Splits a comma list into items of up to `max_parts` colon-separated
 * unsigned numbers; `rows` receives max_parts numbers per item (missing
 * trailing parts are NOT_AVAILABLE_U64). Returns the item count or -1. */
static int parse_rows(char *s, unsigned int max_parts, unsigned long long *rows, int max_rows)
{
    int n = 0;
    char *items;
    for (char *item = strtok_r(s, ",", &items); item; item = strtok_r(NULL, ",", &items)) {
        item = trim(item);
        if (*item == '\0')
            continue;
        if (n >= max_rows)
            return -1;
        unsigned long long *row = rows + (size_t)n * max_parts;
        unsigned int parts = 0;
        char *save;
        for (char *p = strtok_r(item, ":", &save); p; p = strtok_r(NULL, ":", &save)) {
            p = trim(p);
            if (parts >= max_parts || !parse_u64(p, &row[parts]))
                return -1;
            parts++;
        }
        if (parts == 0)
            return -1;
        for (; parts < max_parts; parts++)
            row[parts] = NOT_AVAILABLE_U64;
        n++;
    }
    return n;
}

/* -------------------------------------------------------------- state keys */

enum key_kind {
    K_U32, K_U64, K_BOOL, K_STR, K_DELAY, K_PERIOD, K_BUSID, K_CC,
    K_PROCS, K_PUTIL, K_XID, K_REMAP,
};

struct dev_key {
    const char *name;
    enum key_kind kind;
    size_t off;
    size_t arg; /* K_STR: buffer size; K_PROCS: proc_kind */
};

#define F(member) offsetof(struct dev_state, member)
static struct dev_key dev_keys[] = {
    {"name", K_STR, F(name), STR_LEN},
    {"uuid", K_STR, F(uuid), STR_LEN},
    {"serial", K_STR, F(serial), STR_LEN},
    {"pci.bus_id", K_BUSID, F(bus_id), 0},
    {"pci.device_id", K_U32, F(pci_device_id), 0},
    {"pci.subsystem_id", K_U32, F(pci_subsystem_id), 0},
    {"minor_number", K_U32, F(minor), 0},
    {"brand", K_U32, F(brand), 0},
    {"architecture", K_U32, F(arch), 0},
    {"cuda_cc", K_CC, 0, 0},
    {"vbios_version", K_STR, F(vbios), 32},
    {"lost", K_BOOL, F(lost), 0},
    {"utilization.gpu", K_U32, F(util_gpu), 0},
    {"utilization.memory", K_U32, F(util_mem), 0},
    {"utilization.encoder", K_U32, F(util_enc), 0},
    {"utilization.decoder", K_U32, F(util_dec), 0},
    {"memory.total", K_U64, F(mem_total), 0},
    {"memory.used", K_U64, F(mem_used), 0},
    {"memory.reserved", K_U64, F(mem_reserved), 0},
    {"bar1.total", K_U64, F(bar1_total), 0},
    {"bar1.used", K_U64, F(bar1_used), 0},
    {"temp.gpu", K_U32, F(temp), 0},
    {"temp.threshold.slowdown", K_U32, F(temp_slowdown), 0},
    {"temp.threshold.shutdown", K_U32, F(temp_shutdown), 0},
    {"power.usage", K_U32, F(power_usage), 0},
    {"power.limit", K_U32, F(power_limit), 0},
    {"power.management_limit", K_U32, F(power_mgmt_limit), 0},
    {"power.default_limit", K_U32, F(power_default_limit), 0},
    {"power.min_limit", K_U32, F(power_min_limit), 0},
    {"power.max_limit", K_U32, F(power_max_limit), 0},
    {"energy", K_U64, F(energy), 0},
    {"clock.graphics", K_U32, F(clock[CLOCK_GRAPHICS]), 0},
    {"clock.sm", K_U32, F(clock[CLOCK_SM]), 0},
    {"clock.mem", K_U32, F(clock[CLOCK_MEM]), 0},
    {"clock.video", K_U32, F(clock[CLOCK_VIDEO]), 0},
    {"clock.max.graphics", K_U32, F(clock_max[CLOCK_GRAPHICS]), 0},
    {"clock.max.sm", K_U32, F(clock_max[CLOCK_SM]), 0},
    {"clock.max.mem", K_U32, F(clock_max[CLOCK_MEM]), 0},
    {"clock.max.video", K_U32, F(clock_max[CLOCK_VIDEO]), 0},
    {"throttle_reasons", K_U64, F(throttle), 0},
    {"pcie.tx", K_U32, F(pcie_tx), 0},
    {"pcie.rx", K_U32, F(pcie_rx), 0},
    {"pcie.replay_counter", K_U32, F(pcie_replay), 0},
    {"pcie.link_gen", K_U32, F(link_gen), 0},
    {"pcie.link_width", K_U32, F(link_width), 0},
    {"pcie.max_link_gen", K_U32, F(max_link_gen), 0},
    {"pcie.max_link_width", K_U32, F(max_link_width), 0},
    {"fan.speed", K_U32, F(fan_speed), 0},
    {"fan.count", K_U32, F(fan_count), 0},
    {"pstate", K_U32, F(pstate), 0},
    {"persistence_mode", K_BOOL, F(persistence), 0},
    {"display_active", K_BOOL, F(display_active), 0},
    {"display_mode", K_BOOL, F(display_mode), 0},
    {"compute_mode", K_U32, F(compute_mode), 0},
    {"ecc.supported", K_BOOL, F(ecc_supported), 0},
    {"ecc.corrected.volatile", K_U64, F(ecc[0][0]), 0},
    {"ecc.corrected.aggregate", K_U64, F(ecc[0][1]), 0},
    {"ecc.uncorrected.volatile", K_U64, F(ecc[1][0]), 0},
    {"ecc.uncorrected.aggregate", K_U64, F(ecc[1][1]), 0},
    {"remapped_rows", K_REMAP, 0, 0},
    {"procs", K_PROCS, 0, PROCS_COMPUTE},
    {"graphics_procs", K_PROCS, 0, PROCS_GRAPHICS},
    {"mps_procs", K_PROCS, 0, PROCS_MPS},
    {"procs_util", K_PUTIL, 0, 0},
    {"xid", K_XID, 0, 0},
    {"sample_period_us", K_PERIOD, F(sample_period_us), 0},
    {"delay_us", K_DELAY, F(delay_us), 0},
};
#undef F
#define N_DEV_KEYS (sizeof(dev_keys) / sizeof(dev_keys[0]))

static int key_cmp(const void *a, const void *b)
{
    return strcmp(((const struct dev_key *)a)->name, ((const struct dev_key *)b)->name);
}

static const struct dev_key *find_dev_key(const char *name)
{
    struct dev_key probe = {.name = name};
    return bsearch(&probe, dev_keys, N_DEV_KEYS, sizeof dev_keys[0], key_cmp);
}

/* field.<id> or field.<id>.<scope>; the value is a number or an error name */
static bool set_field(struct dev_state *d, const char *spec, const char *value)
{
    char *end;
    errno = 0;
    unsigned long id = strtoul(spec, &end, 10);
    if (end == spec || errno || id > UINT_MAX)
        return false;
    struct field_entry e = {.id = (unsigned int)id, .any_scope = true};
    if (*end == '.') {
        const char *scope = end + 1;
        unsigned long s = strtoul(scope, &end, 10);
        if (end == scope || *end || s > UINT_MAX)
            return false;
        e.scope = (unsigned int)s;
        e.any_scope = false;
    } else if (*end) {
        return false;
    }
    /* integers keep their sign in the value type; anything else numeric is
     * a double; a name is a per-entry error */
    errno = 0;
    if (*value == '\0') {
        return false;
    } else if (e.value.ullVal = strtoull(value, &end, 0), *value != '-' && !*end && !errno) {
        e.type = VALUE_TYPE_UNSIGNED_LONG_LONG;
    } else if (errno = 0, e.value.sllVal = strtoll(value, &end, 0), !*end && !errno) {
        e.type = VALUE_TYPE_SIGNED_LONG_LONG;
    } else if (e.value.dVal = strtod(value, &end), !*end) {
        e.type = VALUE_TYPE_DOUBLE;
    } else {
        e.value.ullVal = 0;
        if (!parse_error(value, &e.ret))
            return false;
    }
    for (unsigned int i = 0; i < d->n_fields; i++) {
        struct field_entry *f = &d->fields[i];
        if (f->id == e.id && f->any_scope == e.any_scope && f->scope == e.scope) {
            *f = e;
            return true;
        }
    }
    if (d->n_fields >= MAX_FIELDS)
        return false;
    d->fields[d->n_fields++] = e;
    return true;
}

/* Returns false when the value is bad; unknown keys are reported here. */
static bool set_dev_key(struct dev_state *d, const char *key, char *value, const char *full_key)
{
    if (strncmp(key, "err.", 4) == 0) {
        int fn = fn_lookup(key + 4);
        if (fn < 0) {
            warn_unknown(full_key);
            return true;
        }
        return parse_error(value, &d->err[fn]);
    }
    if (strncmp(key, "field.", 6) == 0)
        return set_field(d, key + 6, value);
    const struct dev_key *k = find_dev_key(key);
    if (!k) {
        warn_unknown(full_key);
        return true;
    }
    char *base = (char *)d;
    unsigned long long rows[MAX_XIDS * 5];
    int n;
    switch (k->kind) {
    case K_U32:
        return parse_u32(value, (unsigned int *)(base + k->off));
    case K_U64:
        return parse_u64(value, (unsigned long long *)(base + k->off));
    case K_BOOL:
        return parse_bool(value, (unsigned int *)(base + k->off));
    case K_STR:
        return parse_string(value, base + k->off, k->arg);
    case K_DELAY: {
        unsigned int v;
        if (!parse_u32(value, &v) || v > INT_MAX)
            return false;
        d->delay_us = (int)v;
        return true;
    }
    case K_PERIOD: {
        unsigned int v;
        if (!parse_u32(value, &v) || v == 0)
            return false;
        d->sample_period_us = v;
        return true;
    }
    case K_BUSID: {
        unsigned int parts[4];
        if (!parse_bus_id(value, parts))
            return false;
        d->pci_domain = parts[0], d->pci_bus = parts[1];
        d->pci_dev = parts[2], d->pci_fn = parts[3];
        return true;
    }
    case K_CC: {
        unsigned int major, minor;
        char tail;
        if (sscanf(value, "%u.%u%c", &major, &minor, &tail) != 2)
            return false;
        d->cc_major = major, d->cc_minor = minor;
        return true;
    }
    case K_PROCS:
        n = parse_rows(value, 2, rows, MAX_PROCS);
        for (int i = 0; i < n; i++)
            if (rows[2 * i] > UINT_MAX)
                n = -1;
        if (n < 0)
            return false;
        for (int i = 0; i < n; i++) {
            d->procs[k->arg][i].pid = (unsigned int)rows[2 * i];
            d->procs[k->arg][i].used = rows[2 * i + 1];
        }
        d->n_procs[k->arg] = (unsigned int)n;
        return true;
    case K_PUTIL:
        n = parse_rows(value, 5, rows, MAX_PROCS);
        if (n < 0)
            return false;
        for (int i = 0; i < n; i++) {
            unsigned int v[5];
            for (int j = 0; j < 5; j++) /* missing trailing parts are 0 % */
                v[j] = rows[5 * i + j] == NOT_AVAILABLE_U64 ? 0 : (unsigned int)rows[5 * i + j];
            d->util[i] = (struct proc_util){v[0], v[1], v[2], v[3], v[4]};
        }
        d->n_util = (unsigned int)n;
        return true;
    case K_XID:
        n = parse_rows(value, 1, rows, MAX_XIDS);
        if (n < 0)
            return false;
        for (int i = 0; i < n; i++)
            d->xid[i] = (unsigned int)rows[i];
        d->n_xid = (unsigned int)n;
        return true;
    case K_REMAP:
        n = parse_rows(value, 4, rows, 1);
        if (n < 0)
            return false;
        d->has_remapped = n == 1;
        for (int j = 0; j < 4; j++)
            d->remapped[j] = n == 1 && rows[j] != NOT_AVAILABLE_U64 ? (unsigned int)rows[j] : 0;
        return true;
    }
    return false;
}

static bool set_global_key(struct fake_state *s, const char *key, const char *value)
{
    if (strcmp(key, "device_count") == 0) {
        unsigned int v;
        if (!parse_u32(value, &v) || v > MAX_DEVICES)
            return false;
        s->device_count = v;
        return true;
    }
    if (strcmp(key, "driver_version") == 0)
        return parse_string(value, s->driver_version, VERSION_LEN);
    if (strcmp(key, "nvml_version") == 0)
        return parse_string(value, s->nvml_version, VERSION_LEN);
    if (strcmp(key, "cuda_driver_version") == 0) {
        unsigned int v;
        if (!parse_u32(value, &v) || v > INT_MAX)
            return false;
        s->cuda_driver_version = (int)v;
        return true;
    }
    if (strcmp(key, "delay_us") == 0)
        return parse_u32(value, &s->delay_us);
    if (strncmp(key, "err.", 4) == 0) {
        int fn = fn_lookup(key + 4);
        if (fn >= 0)
            return parse_error(value, &s->err[fn]);
    }
    warn_unknown(key);
    return true;
}

/* ---------------------------------------------------------------- defaults */

static unsigned long long mix64(unsigned long long x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* An idle RTX 4090-like card. */
static void default_device(struct dev_state *d, unsigned int index)
{
    static struct dev_state tmpl;
    static bool ready;
    if (!ready) {
        struct dev_state *t = &tmpl;
        memset(t, 0, sizeof *t);
        strcpy(t->name, "NVIDIA GeForce RTX 4090");
        strcpy(t->vbios, "95.02.3C.40.B1");
        t->pci_device_id = 0x268410DE;
        t->pci_subsystem_id = 0x167C10DE;
        t->brand = 5; /* NVML_BRAND_GEFORCE */
        t->arch = 8;  /* NVML_DEVICE_ARCH_ADA */
        t->cc_major = 8, t->cc_minor = 9;
        t->mem_total = 24564ull << 20;
        t->mem_reserved = 336ull << 20;
        t->bar1_total = 256ull << 20;
        t->bar1_used = 5ull << 20;
        t->temp = 35, t->temp_slowdown = 87, t->temp_shutdown = 92;
        t->power_usage = 30000, t->power_limit = 450000;
        t->power_mgmt_limit = UNSET_U32; /* follows power.limit unless set */
        t->power_default_limit = 450000;
        t->power_min_limit = 150000, t->power_max_limit = 600000;
        t->clock[CLOCK_GRAPHICS] = 210, t->clock[CLOCK_SM] = 210;
        t->clock[CLOCK_MEM] = 405, t->clock[CLOCK_VIDEO] = 1185;
        t->clock_max[CLOCK_GRAPHICS] = 3120, t->clock_max[CLOCK_SM] = 3120;
        t->clock_max[CLOCK_MEM] = 10501, t->clock_max[CLOCK_VIDEO] = 2415;
        t->link_gen = 4, t->link_width = 16, t->max_link_gen = 4, t->max_link_width = 16;
        t->fan_speed = 30, t->fan_count = 1;
        t->pstate = 8, t->persistence = 1;
        t->sample_period_us = 166667;
        t->delay_us = -1;
        ready = true;
    }
    memcpy(d, &tmpl, offsetof(struct dev_state, procs));
    unsigned long long r = mix64(index);
    snprintf(d->uuid, sizeof d->uuid, "GPU-%08x-%04x-%04x-%04x-%012llx",
             (unsigned int)(r >> 32), (unsigned int)(r >> 16) & 0xFFFF,
             0x4000 | ((unsigned int)r & 0x0FFF), 0x8000 | (index & 0x3FFF),
             mix64(r) & 0xFFFFFFFFFFFFull);
    snprintf(d->serial, sizeof d->serial, "1324023%06u", index);
    d->pci_bus = index + 1;
    d->minor = index;
}

static void default_state(struct fake_state *s)
{
    s->device_count = 1;
    strcpy(s->driver_version, "595.71.05");
    strcpy(s->nvml_version, "13.595.71.05");
    s->cuda_driver_version = 13020;
    s->delay_us = 0;
    memset(s->err, 0, sizeof s->err);
}

static void finish_device(struct dev_state *d)
{
    if (d->power_mgmt_limit == UNSET_U32)
        d->power_mgmt_limit = d->power_limit;
    snprintf(d->bus_id, sizeof d->bus_id, "%08X:%02X:%02X.%X", d->pci_domain, d->pci_bus,
             d->pci_dev, d->pci_fn);
}

/* ------------------------------------------------------------------ parser */

struct line {
    char *key, *value;
};

static struct line *g_lines;
static size_t g_lines_cap;

/* Parses `text` (modified in place) into *s. Global keys go first because
 * device_count decides how many devices get defaults; then gpu*.<key>, then
 * gpuN.<key>, so that file order never matters. */
static bool parse_state(char *text, struct fake_state *s)
{
    size_t n = 0;
    for (char *save, *raw = strtok_r(text, "\n", &save); raw; raw = strtok_r(NULL, "\n", &save)) {
        char *line = trim(raw);
        if (*line == '\0' || *line == '#')
            continue;
        char *eq = strchr(line, '=');
        if (!eq) {
            char msg[512];
            snprintf(msg, sizeof msg, "malformed state line '%s'", line);
            warn_once(msg);
            continue;
        }
        *eq = '\0';
        if (n == g_lines_cap) {
            size_t cap = g_lines_cap ? 2 * g_lines_cap : 256;
            struct line *grown = realloc(g_lines, cap * sizeof *grown);
            if (!grown)
                return false;
            g_lines = grown, g_lines_cap = cap;
        }
        g_lines[n].key = trim(line);
        g_lines[n].value = trim(eq + 1);
        n++;
    }

    default_state(s);
    for (size_t i = 0; i < n; i++) {
        struct line *l = &g_lines[i];
        if (strncmp(l->key, "gpu", 3) != 0 && !set_global_key(s, l->key, l->value))
            warn_value(l->key, l->value);
    }
    for (unsigned int i = 0; i < s->device_count; i++)
        default_device(&s->dev[i], i);

    for (int pass = 0; pass < 2; pass++) {
        for (size_t i = 0; i < n; i++) {
            struct line *l = &g_lines[i];
            if (strncmp(l->key, "gpu", 3) != 0)
                continue;
            const char *p = l->key + 3;
            bool all = *p == '*';
            unsigned long index = 0;
            char *dot;
            if (all) {
                dot = (char *)p + 1;
            } else {
                errno = 0;
                index = strtoul(p, &dot, 10);
                if (dot == p || errno)
                    dot = (char *)p; /* not gpuN: fails the '.' check below */
            }
            if (*dot != '.' || index >= MAX_DEVICES) {
                if (pass == 0)
                    warn_unknown(l->key);
                continue;
            }
            if (all != (pass == 0))
                continue;
            unsigned int first = all ? 0 : (unsigned int)index;
            unsigned int last = all ? s->device_count : (unsigned int)index + 1;
            if (first >= s->device_count) {
                /* a removed device's lines may stay in the file; check the
                 * key name anyway so typos still warn */
                if (strncmp(dot + 1, "err.", 4) != 0 && strncmp(dot + 1, "field.", 6) != 0 &&
                    !find_dev_key(dot + 1))
                    warn_unknown(l->key);
                continue;
            }
            for (unsigned int d = first; d < last; d++) {
                /* list parsers tokenise in place, so each device gets a copy */
                char value[4096];
                if (!parse_string(l->value, value, sizeof value) ||
                    !set_dev_key(&s->dev[d], dot + 1, value, l->key)) {
                    warn_value(l->key, l->value);
                    break;
                }
            }
        }
    }
    for (unsigned int i = 0; i < s->device_count; i++)
        finish_device(&s->dev[i]);
    return true;
}

/* ---------------------------------------------------------- sample history */

static unsigned int sample_value(const struct dev_state *d, unsigned int type)
{
    switch (type) {
    case 0: return d->power_usage;
    case 1: return d->util_gpu;
    case 2: return d->util_mem;
    case 3: return d->util_enc;
    case 4: return d->util_dec;
    case 5: return d->clock[CLOCK_GRAPHICS];
    default: return d->clock[CLOCK_MEM];
    }
}

static unsigned long long history_last(unsigned int i)
{
    const struct history *h = &g_hist[i];
    return h->n ? h->ts[(h->head + h->n - 1) % RING_LEN] : 0;
}

static void history_reset(unsigned int i, unsigned long long from_us, unsigned int period)
{
    struct history *h = &g_hist[i];
    h->head = h->n = 0;
    /* first grid point at or after from_us on the grid that starts at t0 */
    unsigned long long t = g_grid_t0;
    if (from_us > t)
        t += (from_us - t + period - 1) / period * period;
    h->next_ts = t;
}

/* Fills grid points up to and including `until_us` with d's values. */
static void history_advance(unsigned int i, const struct dev_state *d, unsigned long long period,
                            unsigned long long until_us)
{
    struct history *h = &g_hist[i];
    if (h->next_ts > until_us)
        return;
    unsigned long long points = (until_us - h->next_ts) / period + 1;
    if (points > RING_LEN) {
        h->next_ts += (points - RING_LEN) * period;
        points = RING_LEN;
    }
    for (unsigned long long k = 0; k < points; k++) {
        unsigned int slot;
        if (h->n < RING_LEN) {
            slot = (h->head + h->n++) % RING_LEN;
        } else {
            slot = h->head;
            h->head = (h->head + 1) % RING_LEN;
        }
        h->ts[slot] = h->next_ts;
        for (unsigned int t = 0; t < N_SAMPLE_TYPES; t++)
            h->val[t][slot] = sample_value(d, t);
        h->next_ts += period;
    }
}

/* Grid points already filled at or after `from_us` take d's values: with
 * FAKE_NVML_RELOAD the change may be noticed after the grid moved past it. */
static void history_restamp(unsigned int i, const struct dev_state *d, unsigned long long from_us)
{
    struct history *h = &g_hist[i];
    for (unsigned int k = 0; k < h->n; k++) {
        unsigned int slot = (h->head + k) % RING_LEN;
        if (h->ts[slot] >= from_us)
            for (unsigned int t = 0; t < N_SAMPLE_TYPES; t++)
                h->val[t][slot] = sample_value(d, t);
    }
}

/* ------------------------------------------------------------------ loader */

static void file_id_of(const struct stat *st, struct file_id *id)
{
    id->dev = st->st_dev;
    id->ino = st->st_ino;
    id->size = st->st_size;
    id->mtime_ns = (long long)st->st_mtim.tv_sec * 1000000000LL + st->st_mtim.tv_nsec;
    id->ctime_ns = (long long)st->st_ctim.tv_sec * 1000000000LL + st->st_ctim.tv_nsec;
}

static bool same_file(const struct file_id *a, const struct file_id *b)
{
    return a->dev == b->dev && a->ino == b->ino && a->size == b->size &&
           a->mtime_ns == b->mtime_ns && a->ctime_ns == b->ctime_ns;
}

/* The old state stays current until `next` has replaced it: grid points
 * before the new file's mtime keep the old values. A new sample period
 * re-spaces the grid from its last point. */
static void on_state_change(const struct fake_state *old, const struct fake_state *next,
                            unsigned long long mtime_us)
{
    /* a writer's clock may run ahead; never invent samples from the future */
    unsigned long long now = now_us();
    unsigned long long until = mtime_us == 0 ? 0 : mtime_us - 1 < now ? mtime_us - 1 : now;
    for (unsigned int i = 0; i < old->device_count; i++) {
        unsigned int period = old->dev[i].sample_period_us;
        if (i < next->device_count && next->dev[i].sample_period_us != period) {
            period = next->dev[i].sample_period_us;
            if (g_hist[i].n)
                g_hist[i].next_ts = history_last(i) + period;
        }
        history_advance(i, &old->dev[i], period, until);
    }
    for (unsigned int i = 0; i < next->device_count; i++) {
        if (i >= old->device_count)
            history_reset(i, mtime_us, next->dev[i].sample_period_us);
        else
            history_restamp(i, &next->dev[i], mtime_us);
    }
    unsigned int common = old->device_count < next->device_count ? old->device_count
                                                                 : next->device_count;
    for (struct fake_event_set *set = g_sets; set; set = set->next)
        for (unsigned int i = 0; i < common; i++)
            if (next->dev[i].n_xid < old->dev[i].n_xid)
                set->delivered[i] = 0;
}

#define MAX_STATE_BYTES (16u << 20)

/* Reads and parses `path` into the spare buffer and swaps it in. On any
 * failure the current state stays. `initial` starts a fresh sample grid. */
static bool load_state(const char *path, bool initial)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return false;
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size > MAX_STATE_BYTES) {
        close(fd);
        return false;
    }
    size_t want = (size_t)st.st_size + 1;
    if (want > g_text_cap) {
        char *grown = realloc(g_text, want);
        if (!grown) {
            close(fd);
            return false;
        }
        g_text = grown, g_text_cap = want;
    }
    size_t got = 0;
    while (got + 1 < g_text_cap) {
        ssize_t r = read(fd, g_text + got, g_text_cap - 1 - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            close(fd);
            return false;
        }
        if (r == 0)
            break;
        got += (size_t)r;
    }
    close(fd);
    g_text[got] = '\0';
    if (!parse_state(g_text, g_spare))
        return false;

    unsigned long long mtime_us = (unsigned long long)st.st_mtim.tv_sec * 1000000ull +
                                  (unsigned long long)st.st_mtim.tv_nsec / 1000ull;
    if (initial) {
        g_grid_t0 = now_us();
        for (unsigned int i = 0; i < MAX_DEVICES; i++)
            history_reset(i, g_grid_t0, 1);
    } else {
        on_state_change(g_cur, g_spare, mtime_us);
    }
    struct fake_state *old = g_cur;
    g_cur = g_spare;
    g_spare = old;
    file_id_of(&st, &g_file);
    return true;
}

/* Called with g_lock held on every initialised call. */
static void maybe_reload(void)
{
    if (g_reload_interval_us) {
        unsigned long long now = clock_us(CLOCK_MONOTONIC);
        if (now - g_last_check_us < g_reload_interval_us)
            return;
        g_last_check_us = now;
    }
    struct stat st;
    struct file_id id;
    if (stat(g_path, &st) != 0)
        return; /* vanished: keep the last good state */
    file_id_of(&st, &id);
    if (!same_file(&id, &g_file))
        load_state(g_path, false);
}

/* ---------------------------------------------------------- call framework */

/* Every entry point takes g_lock through enter_*() and leaves through
 * finish(), which releases it and then sleeps the injected delay. */
static nvmlReturn_t finish(nvmlReturn_t ret, unsigned int delay_us)
{
    pthread_mutex_unlock(&g_lock);
    if (delay_us)
        sleep_us(delay_us);
    return ret;
}

static nvmlReturn_t enter_system(enum fn_id fn, unsigned int *delay)
{
    count_call(fn);
    pthread_mutex_lock(&g_lock);
    *delay = 0;
    if (g_refcount == 0)
        return NVML_ERROR_UNINITIALIZED;
    maybe_reload();
    *delay = g_cur->delay_us;
    return g_cur->err[fn];
}

/* Device index of a live device, or a device-level error. */
static nvmlReturn_t check_device(enum fn_id fn, unsigned int i, unsigned int *delay)
{
    const struct dev_state *d = &g_cur->dev[i];
    if (i >= g_cur->device_count)
        return NVML_ERROR_GPU_IS_LOST; /* hot-removed */
    if (d->delay_us >= 0)
        *delay = (unsigned int)d->delay_us;
    if (d->lost)
        return NVML_ERROR_GPU_IS_LOST;
    return d->err[fn] ? d->err[fn] : g_cur->err[fn];
}

static nvmlReturn_t enter_device(enum fn_id fn, nvmlDevice_t h, unsigned int *index,
                                 unsigned int *delay)
{
    count_call(fn);
    pthread_mutex_lock(&g_lock);
    *delay = 0;
    if (g_refcount == 0)
        return NVML_ERROR_UNINITIALIZED;
    maybe_reload();
    *delay = g_cur->delay_us;
    uintptr_t p = (uintptr_t)h, base = (uintptr_t)g_handles;
    if (p < base || p >= base + sizeof g_handles || (p - base) % sizeof g_handles[0])
        return NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned int)((p - base) / sizeof g_handles[0]);
    return check_device(fn, *index, delay);
}

/* BEGIN_* declare `ret`, `delay` and, for devices, `idx` and `d`; END(x)
 * leaves through finish(). */
#define BEGIN_SYSTEM_ID(id)                                                     \
    unsigned int delay;                                                         \
    nvmlReturn_t ret = enter_system(id, &delay);                                \
    if (ret != NVML_SUCCESS)                                                    \
        return finish(ret, delay)

#define BEGIN_DEVICE_ID(id, handle)                                             \
    unsigned int delay, idx = 0;                                                \
    nvmlReturn_t ret = enter_device(id, handle, &idx, &delay);                  \
    if (ret != NVML_SUCCESS)                                                    \
        return finish(ret, delay);                                              \
    const struct dev_state *d = &g_cur->dev[idx];                               \
    (void)d

#define BEGIN_SYSTEM(fn) BEGIN_SYSTEM_ID(FN_##fn)
#define BEGIN_DEVICE(fn, handle) BEGIN_DEVICE_ID(FN_##fn, handle)

#define END(x) return finish((x), delay)
#define REQUIRE(cond)                                                           \
    do {                                                                        \
        if (!(cond))                                                            \
            END(NVML_ERROR_INVALID_ARGUMENT);                                   \
    } while (0)

static nvmlReturn_t copy_string(char *dst, unsigned int length, const char *src)
{
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    size_t len = strlen(src);
    if (len + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, len + 1);
    return NVML_SUCCESS;
}

/* ------------------------------------------------------- init and system */

static nvmlReturn_t init_common(enum fn_id fn)
{
    count_call(fn);
    pthread_mutex_lock(&g_lock);
    const char *path = getenv("FAKE_NVML_STATE");
    if (!path || !*path || strlen(path) >= sizeof g_path)
        return finish(NVML_ERROR_DRIVER_NOT_LOADED, 0);
    if (g_refcount == 0 || strcmp(path, g_path) != 0) {
        const char *interval = getenv("FAKE_NVML_RELOAD");
        g_reload_interval_us = interval ? strtoull(interval, NULL, 10) : 0;
        g_last_check_us = clock_us(CLOCK_MONOTONIC);
        if (!load_state(path, g_refcount == 0))
            return finish(NVML_ERROR_DRIVER_NOT_LOADED, 0); /* no kernel module */
        strcpy(g_path, path);
    } else {
        maybe_reload();
    }
    nvmlReturn_t ret = g_cur->err[fn];
    if (ret == NVML_SUCCESS)
        g_refcount++;
    return finish(ret, g_cur->delay_us);
}

nvmlReturn_t nvmlInit(void)
{
    return init_common(FN_nvmlInit);
}

nvmlReturn_t nvmlInit_v2(void)
{
    return init_common(FN_nvmlInit_v2);
}

/* flags (NO_GPUS, NO_ATTACH) change nothing in the fake */
nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    return init_common(FN_nvmlInitWithFlags);
}

nvmlReturn_t nvmlShutdown(void)
{
    BEGIN_SYSTEM(nvmlShutdown);
    g_refcount--;
    END(NVML_SUCCESS);
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    count_call(FN_nvmlErrorString);
    for (size_t i = 0; i < N_ERROR_CODES; i++)
        if (error_codes[i].code == result)
            return error_codes[i].text;
    return "Unknown Error";
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    BEGIN_SYSTEM(nvmlSystemGetDriverVersion);
    END(copy_string(version, length, g_cur->driver_version));
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    BEGIN_SYSTEM(nvmlSystemGetNVMLVersion);
    END(copy_string(version, length, g_cur->nvml_version));
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    BEGIN_SYSTEM(nvmlSystemGetCudaDriverVersion);
    REQUIRE(cudaDriverVersion);
    *cudaDriverVersion = g_cur->cuda_driver_version;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    BEGIN_SYSTEM(nvmlSystemGetCudaDriverVersion_v2);
    REQUIRE(cudaDriverVersion);
    *cudaDriverVersion = g_cur->cuda_driver_version;
    END(NVML_SUCCESS);
}

/* The process's argv[0], as nvidia-smi shows it. */
nvmlReturn_t nvmlSystemGetProcessName(unsigned int pid, char *name, unsigned int length)
{
    BEGIN_SYSTEM(nvmlSystemGetProcessName);
    REQUIRE(name && length > 0);
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%u/cmdline", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        END(NVML_ERROR_NOT_FOUND);
    ssize_t r = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (r <= 0)
        END(NVML_ERROR_NOT_FOUND);
    buf[r] = '\0';
    END(copy_string(name, length, buf));
}

/* ---------------------------------------------------------------- handles */

static nvmlReturn_t get_count(enum fn_id fn, unsigned int *count)
{
    BEGIN_SYSTEM_ID(fn);
    REQUIRE(count);
    *count = g_cur->device_count;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount)
{
    return get_count(FN_nvmlDeviceGetCount, deviceCount);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    return get_count(FN_nvmlDeviceGetCount_v2, deviceCount);
}

/* Shared tail of the GetHandleBy* calls once a device index is chosen. */
static nvmlReturn_t hand_out(enum fn_id fn, unsigned int i, nvmlDevice_t *device,
                             unsigned int delay)
{
    nvmlReturn_t ret = check_device(fn, i, &delay);
    if (ret == NVML_SUCCESS)
        *device = &g_handles[i];
    return finish(ret, delay);
}

static nvmlReturn_t handle_by_index(enum fn_id fn, unsigned int index, nvmlDevice_t *device)
{
    BEGIN_SYSTEM_ID(fn);
    REQUIRE(device && index < g_cur->device_count);
    return hand_out(fn, index, device, delay);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return handle_by_index(FN_nvmlDeviceGetHandleByIndex, index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    return handle_by_index(FN_nvmlDeviceGetHandleByIndex_v2, index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    BEGIN_SYSTEM(nvmlDeviceGetHandleByUUID);
    REQUIRE(uuid && device);
    for (unsigned int i = 0; i < g_cur->device_count; i++)
        if (strcmp(g_cur->dev[i].uuid, uuid) == 0)
            return hand_out(FN_nvmlDeviceGetHandleByUUID, i, device, delay);
    END(NVML_ERROR_NOT_FOUND);
}

static nvmlReturn_t handle_by_bus_id(enum fn_id fn, const char *bus_id, nvmlDevice_t *device)
{
    BEGIN_SYSTEM_ID(fn);
    unsigned int want[4];
    REQUIRE(bus_id && device && parse_bus_id(bus_id, want));
    for (unsigned int i = 0; i < g_cur->device_count; i++) {
        const struct dev_state *d = &g_cur->dev[i];
        if (d->pci_domain == want[0] && d->pci_bus == want[1] && d->pci_dev == want[2] &&
            d->pci_fn == want[3])
            return hand_out(fn, i, device, delay);
    }
    END(NVML_ERROR_NOT_FOUND);
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device)
{
    return handle_by_bus_id(FN_nvmlDeviceGetHandleByPciBusId, pciBusId, device);
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device)
{
    return handle_by_bus_id(FN_nvmlDeviceGetHandleByPciBusId_v2, pciBusId, device);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    BEGIN_DEVICE(nvmlDeviceGetIndex, device);
    REQUIRE(index);
    *index = idx;
    END(NVML_SUCCESS);
}

/* ---------------------------------------------------------- plain getters */

/* A getter returning one scalar field of the device. */
#define DEVICE_GETTER(fn, type, expr)                                           \
    nvmlReturn_t fn(nvmlDevice_t device, type *out)                             \
    {                                                                           \
        BEGIN_DEVICE(fn, device);                                               \
        REQUIRE(out);                                                           \
        *out = (type)(expr);                                                    \
        END(NVML_SUCCESS);                                                      \
    }

DEVICE_GETTER(nvmlDeviceGetMinorNumber, unsigned int, d->minor)
DEVICE_GETTER(nvmlDeviceGetBrand, unsigned int, d->brand)
DEVICE_GETTER(nvmlDeviceGetArchitecture, unsigned int, d->arch)
DEVICE_GETTER(nvmlDeviceGetPowerUsage, unsigned int, d->power_usage)
DEVICE_GETTER(nvmlDeviceGetEnforcedPowerLimit, unsigned int, d->power_limit)
DEVICE_GETTER(nvmlDeviceGetPowerManagementLimit, unsigned int, d->power_mgmt_limit)
DEVICE_GETTER(nvmlDeviceGetPowerManagementDefaultLimit, unsigned int, d->power_default_limit)
DEVICE_GETTER(nvmlDeviceGetTotalEnergyConsumption, unsigned long long, d->energy)
DEVICE_GETTER(nvmlDeviceGetCurrentClocksThrottleReasons, unsigned long long, d->throttle)
DEVICE_GETTER(nvmlDeviceGetCurrentClocksEventReasons, unsigned long long, d->throttle)
DEVICE_GETTER(nvmlDeviceGetPcieReplayCounter, unsigned int, d->pcie_replay)
DEVICE_GETTER(nvmlDeviceGetCurrPcieLinkGeneration, unsigned int, d->link_gen)
DEVICE_GETTER(nvmlDeviceGetCurrPcieLinkWidth, unsigned int, d->link_width)
DEVICE_GETTER(nvmlDeviceGetMaxPcieLinkGeneration, unsigned int, d->max_link_gen)
DEVICE_GETTER(nvmlDeviceGetMaxPcieLinkWidth, unsigned int, d->max_link_width)
DEVICE_GETTER(nvmlDeviceGetNumFans, unsigned int, d->fan_count)
DEVICE_GETTER(nvmlDeviceGetPerformanceState, unsigned int, d->pstate)
DEVICE_GETTER(nvmlDeviceGetPersistenceMode, unsigned int, d->persistence)
DEVICE_GETTER(nvmlDeviceGetDisplayActive, unsigned int, d->display_active)
DEVICE_GETTER(nvmlDeviceGetDisplayMode, unsigned int, d->display_mode)
DEVICE_GETTER(nvmlDeviceGetComputeMode, unsigned int, d->compute_mode)
DEVICE_GETTER(nvmlDeviceIsMigDeviceHandle, unsigned int, 0)

/* A call the fake's Linux GeForce card does not support: driver models are
 * Windows-only (WDDM/TCC), MIG needs a data-centre part, and so does
 * confidential computing. */
#define DEVICE_NOT_SUPPORTED(fn, type_a, type_b)                                \
    nvmlReturn_t fn(nvmlDevice_t device, type_a a, type_b b)                    \
    {                                                                           \
        (void)a, (void)b;                                                       \
        BEGIN_DEVICE(fn, device);                                               \
        END(NVML_ERROR_NOT_SUPPORTED);                                          \
    }

DEVICE_NOT_SUPPORTED(nvmlDeviceGetDriverModel, unsigned int *, unsigned int *)
DEVICE_NOT_SUPPORTED(nvmlDeviceGetDriverModel_v2, unsigned int *, unsigned int *)
DEVICE_NOT_SUPPORTED(nvmlDeviceGetMigMode, unsigned int *, unsigned int *)

nvmlReturn_t nvmlDeviceGetConfComputeMemSizeInfo(nvmlDevice_t device,
                                                 nvmlConfComputeMemSizeInfo_t *memInfo)
{
    (void)memInfo;
    BEGIN_DEVICE(nvmlDeviceGetConfComputeMemSizeInfo, device);
    END(NVML_ERROR_NOT_SUPPORTED);
}

/* ------------------------------------------------------- identity, strings */

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    BEGIN_DEVICE(nvmlDeviceGetName, device);
    END(copy_string(name, length, d->name));
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    BEGIN_DEVICE(nvmlDeviceGetUUID, device);
    END(copy_string(uuid, length, d->uuid));
}

nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char *serial, unsigned int length)
{
    BEGIN_DEVICE(nvmlDeviceGetSerial, device);
    END(copy_string(serial, length, d->serial));
}

nvmlReturn_t nvmlDeviceGetVbiosVersion(nvmlDevice_t device, char *version, unsigned int length)
{
    BEGIN_DEVICE(nvmlDeviceGetVbiosVersion, device);
    END(copy_string(version, length, d->vbios));
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    BEGIN_DEVICE(nvmlDeviceGetPciInfo_v3, device);
    REQUIRE(pci);
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X",
             d->pci_domain & 0xFFFF, d->pci_bus, d->pci_dev, d->pci_fn);
    memcpy(pci->busId, d->bus_id, sizeof pci->busId);
    pci->domain = d->pci_domain;
    pci->bus = d->pci_bus;
    pci->device = d->pci_dev;
    pci->pciDeviceId = d->pci_device_id;
    pci->pciSubSystemId = d->pci_subsystem_id;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    BEGIN_DEVICE(nvmlDeviceGetCudaComputeCapability, device);
    REQUIRE(major && minor);
    *major = (int)d->cc_major;
    *minor = (int)d->cc_minor;
    END(NVML_SUCCESS);
}

/* ------------------------------------------------------ utilization, memory */

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization)
{
    BEGIN_DEVICE(nvmlDeviceGetUtilizationRates, device);
    REQUIRE(utilization);
    utilization->gpu = d->util_gpu;
    utilization->memory = d->util_mem;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t device, unsigned int *utilization,
                                             unsigned int *samplingPeriodUs)
{
    BEGIN_DEVICE(nvmlDeviceGetEncoderUtilization, device);
    REQUIRE(utilization && samplingPeriodUs);
    *utilization = d->util_enc;
    *samplingPeriodUs = d->sample_period_us;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t device, unsigned int *utilization,
                                             unsigned int *samplingPeriodUs)
{
    BEGIN_DEVICE(nvmlDeviceGetDecoderUtilization, device);
    REQUIRE(utilization && samplingPeriodUs);
    *utilization = d->util_dec;
    *samplingPeriodUs = d->sample_period_us;
    END(NVML_SUCCESS);
}

static unsigned long long mem_free(const struct dev_state *d)
{
    unsigned long long taken = d->mem_used + d->mem_reserved;
    return taken < d->mem_total ? d->mem_total - taken : 0;
}

/* v1 counts the driver's reserved memory as used; v2 reports it apart */
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    BEGIN_DEVICE(nvmlDeviceGetMemoryInfo, device);
    REQUIRE(memory);
    memory->total = d->mem_total;
    memory->free = mem_free(d);
    memory->used = d->mem_used + d->mem_reserved;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    BEGIN_DEVICE(nvmlDeviceGetMemoryInfo_v2, device);
    REQUIRE(memory);
    if (memory->version != MEMORY_V2)
        END(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    memory->total = d->mem_total;
    memory->reserved = d->mem_reserved;
    memory->free = mem_free(d);
    memory->used = d->mem_used;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetBAR1MemoryInfo(nvmlDevice_t device, nvmlBAR1Memory_t *bar1Memory)
{
    BEGIN_DEVICE(nvmlDeviceGetBAR1MemoryInfo, device);
    REQUIRE(bar1Memory);
    bar1Memory->bar1Total = d->bar1_total;
    bar1Memory->bar1Used = d->bar1_used;
    bar1Memory->bar1Free = d->bar1_used < d->bar1_total ? d->bar1_total - d->bar1_used : 0;
    END(NVML_SUCCESS);
}

/* ------------------------------------------------------- thermals, power */

/* only sensor 0 (NVML_TEMPERATURE_GPU) exists */
nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, unsigned int sensorType,
                                      unsigned int *temp)
{
    BEGIN_DEVICE(nvmlDeviceGetTemperature, device);
    REQUIRE(temp && sensorType == 0);
    *temp = d->temp;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_v1_t *temperature)
{
    BEGIN_DEVICE(nvmlDeviceGetTemperatureV, device);
    REQUIRE(temperature);
    if (temperature->version != TEMPERATURE_V1)
        END(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    REQUIRE(temperature->sensorType == 0);
    temperature->temperature = (int)d->temp;
    END(NVML_SUCCESS);
}

/* thresholds 0 SHUTDOWN and 1 SLOWDOWN; the others (up to 7) a GeForce
 * card does not report */
nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t device, unsigned int thresholdType,
                                               unsigned int *temp)
{
    BEGIN_DEVICE(nvmlDeviceGetTemperatureThreshold, device);
    REQUIRE(temp && thresholdType < 8);
    if (thresholdType > 1)
        END(NVML_ERROR_NOT_SUPPORTED);
    *temp = thresholdType == 0 ? d->temp_shutdown : d->temp_slowdown;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPowerManagementLimitConstraints(nvmlDevice_t device,
                                                          unsigned int *minLimit,
                                                          unsigned int *maxLimit)
{
    BEGIN_DEVICE(nvmlDeviceGetPowerManagementLimitConstraints, device);
    REQUIRE(minLimit && maxLimit);
    *minLimit = d->power_min_limit;
    *maxLimit = d->power_max_limit;
    END(NVML_SUCCESS);
}

/* ------------------------------------------------------- clocks, PCIe, fans */

nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, unsigned int type, unsigned int *clock)
{
    BEGIN_DEVICE(nvmlDeviceGetClockInfo, device);
    REQUIRE(clock && type < CLOCK_COUNT);
    *clock = d->clock[type];
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, unsigned int type,
                                       unsigned int *clock)
{
    BEGIN_DEVICE(nvmlDeviceGetMaxClockInfo, device);
    REQUIRE(clock && type < CLOCK_COUNT);
    *clock = d->clock_max[type];
    END(NVML_SUCCESS);
}

/* counter 0 TX, 1 RX, in KB/s */
nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t device, unsigned int counter,
                                         unsigned int *value)
{
    BEGIN_DEVICE(nvmlDeviceGetPcieThroughput, device);
    REQUIRE(value && counter < 2);
    *value = counter == 0 ? d->pcie_tx : d->pcie_rx;
    END(NVML_SUCCESS);
}

/* fan.count = 0 is a passively cooled card */
nvmlReturn_t nvmlDeviceGetFanSpeed(nvmlDevice_t device, unsigned int *speed)
{
    BEGIN_DEVICE(nvmlDeviceGetFanSpeed, device);
    REQUIRE(speed);
    if (d->fan_count == 0)
        END(NVML_ERROR_NOT_SUPPORTED);
    *speed = d->fan_speed;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetFanSpeed_v2(nvmlDevice_t device, unsigned int fan, unsigned int *speed)
{
    BEGIN_DEVICE(nvmlDeviceGetFanSpeed_v2, device);
    REQUIRE(speed);
    if (d->fan_count == 0)
        END(NVML_ERROR_NOT_SUPPORTED);
    REQUIRE(fan < d->fan_count);
    *speed = d->fan_speed;
    END(NVML_SUCCESS);
}

/* ----------------------------------------------------------- ECC, rows */

/* errorType 0 corrected / 1 uncorrected; counterType 0 volatile / 1 aggregate */
nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, unsigned int errorType,
                                         unsigned int counterType, unsigned long long *eccCounts)
{
    BEGIN_DEVICE(nvmlDeviceGetTotalEccErrors, device);
    if (!d->ecc_supported)
        END(NVML_ERROR_NOT_SUPPORTED);
    REQUIRE(eccCounts && errorType < 2 && counterType < 2);
    *eccCounts = d->ecc[errorType][counterType];
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows,
                                       unsigned int *uncRows, unsigned int *isPending,
                                       unsigned int *failureOccurred)
{
    BEGIN_DEVICE(nvmlDeviceGetRemappedRows, device);
    if (!d->has_remapped)
        END(NVML_ERROR_NOT_SUPPORTED);
    REQUIRE(corrRows && uncRows && isPending && failureOccurred);
    *corrRows = d->remapped[0];
    *uncRows = d->remapped[1];
    *isPending = d->remapped[2];
    *failureOccurred = d->remapped[3];
    END(NVML_SUCCESS);
}

/* --------------------------------------------------------------- processes */

/* Two-call protocol: a NULL buffer or a short *count gets INSUFFICIENT_SIZE
 * and the needed count (SUCCESS when there is nothing to list). */
static nvmlReturn_t list_processes(enum fn_id fn, enum proc_kind kind, bool v1,
                                   nvmlDevice_t device, unsigned int *count, void *infos)
{
    BEGIN_DEVICE_ID(fn, device);
    REQUIRE(count);
    unsigned int n = d->n_procs[kind];
    if (!infos || *count < n) {
        *count = n;
        END(n == 0 ? NVML_SUCCESS : NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (unsigned int i = 0; i < n; i++) {
        const struct proc_entry *p = &d->procs[kind][i];
        if (v1) {
            nvmlProcessInfo_v1_t *out = (nvmlProcessInfo_v1_t *)infos + i;
            memset(out, 0, sizeof *out);
            out->pid = p->pid;
            out->usedGpuMemory = p->used;
        } else {
            nvmlProcessInfo_t *out = (nvmlProcessInfo_t *)infos + i;
            memset(out, 0, sizeof *out);
            out->pid = p->pid;
            out->usedGpuMemory = p->used;
            out->gpuInstanceId = NOT_AVAILABLE_U32; /* no MIG */
            out->computeInstanceId = NOT_AVAILABLE_U32;
        }
    }
    *count = n;
    END(NVML_SUCCESS);
}

#define PROCESS_LIST(fn, kind, v1)                                              \
    nvmlReturn_t fn(nvmlDevice_t device, unsigned int *infoCount, void *infos)  \
    {                                                                           \
        return list_processes(FN_##fn, kind, v1, device, infoCount, infos);     \
    }

PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses, PROCS_COMPUTE, true)
PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses_v2, PROCS_COMPUTE, false)
PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses_v3, PROCS_COMPUTE, false)
PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses, PROCS_GRAPHICS, true)
PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses_v2, PROCS_GRAPHICS, false)
PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses_v3, PROCS_GRAPHICS, false)
PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses, PROCS_MPS, true)
PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v2, PROCS_MPS, false)
PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v3, PROCS_MPS, false)

/* mode 0 compute, 1 graphics, 2 MPS; same size protocol as the lists above,
 * with the count in numProcArrayEntries */
nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t device,
                                                   nvmlProcessDetailList_v1_t *plist)
{
    BEGIN_DEVICE(nvmlDeviceGetRunningProcessDetailList, device);
    REQUIRE(plist);
    if (plist->version != PROCESS_DETAIL_LIST_V1)
        END(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    REQUIRE(plist->mode < PROC_KINDS);
    unsigned int n = d->n_procs[plist->mode];
    if (!plist->procArray || plist->numProcArrayEntries < n) {
        plist->numProcArrayEntries = n;
        END(n == 0 ? NVML_SUCCESS : NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (unsigned int i = 0; i < n; i++) {
        nvmlProcessDetail_v1_t *out = &plist->procArray[i];
        memset(out, 0, sizeof *out);
        out->pid = d->procs[plist->mode][i].pid;
        out->usedGpuMemory = d->procs[plist->mode][i].used;
        out->gpuInstanceId = NOT_AVAILABLE_U32;
        out->computeInstanceId = NOT_AVAILABLE_U32;
    }
    plist->numProcArrayEntries = n;
    END(NVML_SUCCESS);
}

static unsigned long long latest_grid_point(unsigned int i, const struct dev_state *d)
{
    history_advance(i, d, d->sample_period_us, now_us());
    return history_last(i);
}

/* One sample per procs_util entry, stamped with the latest grid point; the
 * size probe answers INSUFFICIENT_SIZE, and nothing new answers NOT_FOUND
 * (what real drivers say when the GPU is idle). */
nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                             nvmlProcessUtilizationSample_t *utilization,
                                             unsigned int *processSamplesCount,
                                             unsigned long long lastSeenTimeStamp)
{
    BEGIN_DEVICE(nvmlDeviceGetProcessUtilization, device);
    REQUIRE(processSamplesCount);
    unsigned long long ts = latest_grid_point(idx, d);
    unsigned int n = d->n_util;
    if (n == 0 || lastSeenTimeStamp >= ts)
        END(NVML_ERROR_NOT_FOUND);
    if (!utilization || *processSamplesCount < n) {
        *processSamplesCount = n;
        END(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (unsigned int i = 0; i < n; i++) {
        nvmlProcessUtilizationSample_t *out = &utilization[i];
        memset(out, 0, sizeof *out);
        out->pid = d->util[i].pid;
        out->timeStamp = ts;
        out->smUtil = d->util[i].sm;
        out->memUtil = d->util[i].mem;
        out->encUtil = d->util[i].enc;
        out->decUtil = d->util[i].dec;
    }
    *processSamplesCount = n;
    END(NVML_SUCCESS);
}

/* ------------------------------------------------------ samples and fields */

/* Samples newer than lastSeenTimeStamp, oldest first. The NULL-buffer probe
 * answers SUCCESS with the count; a buffer smaller than the count (a grid
 * point passed between the two calls) gets the oldest ones, so nothing is
 * lost for a caller that passes its last timestamp next time. */
nvmlReturn_t nvmlDeviceGetSamples(nvmlDevice_t device, unsigned int type,
                                  unsigned long long lastSeenTimeStamp,
                                  unsigned int *sampleValType, unsigned int *sampleCount,
                                  nvmlSample_t *samples)
{
    BEGIN_DEVICE(nvmlDeviceGetSamples, device);
    REQUIRE(sampleValType && sampleCount && type < 10);
    if (type >= N_SAMPLE_TYPES)
        END(NVML_ERROR_NOT_SUPPORTED); /* module power, JPG, OFA */
    history_advance(idx, d, d->sample_period_us, now_us());
    const struct history *h = &g_hist[idx];
    unsigned int first = 0;
    while (first < h->n && h->ts[(h->head + first) % RING_LEN] <= lastSeenTimeStamp)
        first++;
    unsigned int n = h->n - first;
    if (n == 0)
        END(NVML_ERROR_NOT_FOUND);
    *sampleValType = VALUE_TYPE_UNSIGNED_INT;
    if (!samples) {
        *sampleCount = n;
        END(NVML_SUCCESS);
    }
    if (*sampleCount == 0) {
        *sampleCount = n;
        END(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    if (n > *sampleCount)
        n = *sampleCount;
    for (unsigned int k = 0; k < n; k++) {
        unsigned int slot = (h->head + first + k) % RING_LEN;
        memset(&samples[k], 0, sizeof samples[k]);
        samples[k].timeStamp = h->ts[slot];
        samples[k].sampleValue.uiVal = h->val[type][slot];
    }
    *sampleCount = n;
    END(NVML_SUCCESS);
}

static const struct field_entry *find_field(const struct dev_state *d, unsigned int id,
                                            unsigned int scope)
{
    const struct field_entry *any = NULL;
    for (unsigned int i = 0; i < d->n_fields; i++) {
        const struct field_entry *f = &d->fields[i];
        if (f->id != id)
            continue;
        if (!f->any_scope && f->scope == scope)
            return f;
        if (f->any_scope)
            any = f;
    }
    return any;
}

/* Errors are per entry: the call succeeds while an unknown field id gets
 * NOT_SUPPORTED in its own nvmlReturn. */
nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount,
                                      nvmlFieldValue_t *values)
{
    BEGIN_DEVICE(nvmlDeviceGetFieldValues, device);
    REQUIRE(values && valuesCount > 0);
    long long now = (long long)now_us();
    for (int i = 0; i < valuesCount; i++) {
        nvmlFieldValue_t *v = &values[i];
        const struct field_entry *f = find_field(d, v->fieldId, v->scopeId);
        v->timestamp = now;
        v->latencyUsec = 0;
        v->value.ullVal = 0;
        v->valueType = 0;
        if (!f) {
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        } else if (f->ret != NVML_SUCCESS) {
            v->nvmlReturn = f->ret;
        } else {
            v->nvmlReturn = NVML_SUCCESS;
            v->valueType = f->type;
            v->value = f->value;
        }
    }
    END(NVML_SUCCESS);
}

/* ------------------------------------------------------------------ events */

static bool known_set(const struct fake_event_set *set)
{
    for (const struct fake_event_set *s = g_sets; s; s = s->next)
        if (s == set)
            return true;
    return false;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    BEGIN_SYSTEM(nvmlEventSetCreate);
    REQUIRE(set);
    struct fake_event_set *s = calloc(1, sizeof *s);
    if (!s)
        END(20); /* NVML_ERROR_MEMORY */
    s->next = g_sets;
    g_sets = s;
    *set = s;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device,
                                              unsigned long long *eventTypes)
{
    BEGIN_DEVICE(nvmlDeviceGetSupportedEventTypes, device);
    REQUIRE(eventTypes);
    *eventTypes = EVENT_TYPE_XID;
    END(NVML_SUCCESS);
}

/* Only XID events exist; the set starts after the XIDs already listed. */
nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                      nvmlEventSet_t set)
{
    BEGIN_DEVICE(nvmlDeviceRegisterEvents, device);
    REQUIRE(known_set(set));
    if (eventTypes & ~EVENT_TYPE_XID)
        END(NVML_ERROR_NOT_SUPPORTED);
    if (set->types[idx] == 0)
        set->delivered[idx] = d->n_xid;
    set->types[idx] |= eventTypes;
    END(NVML_SUCCESS);
}

/* The next undelivered XID of a registered, present device, lowest index
 * first; fills the legacy layout, a prefix of nvmlEventData_t. */
static bool next_event(struct fake_event_set *set, nvmlEventData_legacy_t *out)
{
    for (unsigned int i = 0; i < g_cur->device_count; i++) {
        const struct dev_state *d = &g_cur->dev[i];
        if (!(set->types[i] & EVENT_TYPE_XID) || d->lost || set->delivered[i] >= d->n_xid)
            continue;
        out->device = &g_handles[i];
        out->eventType = EVENT_TYPE_XID;
        out->eventData = d->xid[set->delivered[i]++];
        return true;
    }
    return false;
}

/* Polls the state file every 2 ms until an event arrives or the timeout
 * passes; the lock is released while waiting. */
static nvmlReturn_t event_wait(enum fn_id fn, nvmlEventSet_t set, void *data, bool v2,
                               unsigned int timeoutms)
{
    unsigned long long deadline = clock_us(CLOCK_MONOTONIC) + 1000ull * timeoutms;
    unsigned int delay;
    nvmlReturn_t ret = enter_system(fn, &delay);
    for (;;) {
        if (ret != NVML_SUCCESS)
            return finish(ret, delay);
        REQUIRE(data && known_set(set));
        nvmlEventData_legacy_t ev;
        if (next_event(set, &ev)) {
            if (v2) {
                nvmlEventData_t *out = data;
                out->device = ev.device;
                out->eventType = ev.eventType;
                out->eventData = ev.eventData;
                out->gpuInstanceId = NOT_AVAILABLE_U32;
                out->computeInstanceId = NOT_AVAILABLE_U32;
            } else {
                memcpy(data, &ev, sizeof ev);
            }
            END(NVML_SUCCESS);
        }
        unsigned long long now = clock_us(CLOCK_MONOTONIC);
        if (now >= deadline)
            END(NVML_ERROR_TIMEOUT);
        pthread_mutex_unlock(&g_lock);
        unsigned long long left = deadline - now;
        sleep_us(left < 2000 ? left : 2000);
        pthread_mutex_lock(&g_lock);
        ret = g_refcount == 0 ? NVML_ERROR_UNINITIALIZED : NVML_SUCCESS;
        if (ret == NVML_SUCCESS)
            maybe_reload();
    }
}

nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_legacy_t *data,
                              unsigned int timeoutms)
{
    return event_wait(FN_nvmlEventSetWait, set, data, false, timeoutms);
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data,
                                 unsigned int timeoutms)
{
    return event_wait(FN_nvmlEventSetWait_v2, set, data, true, timeoutms);
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    BEGIN_SYSTEM(nvmlEventSetFree);
    for (struct fake_event_set **p = &g_sets; *p; p = &(*p)->next) {
        if (*p == set) {
            *p = set->next;
            free(set);
            END(NVML_SUCCESS);
        }
    }
    END(NVML_ERROR_INVALID_ARGUMENT);
}

/* -------------------------------------------------------------- test hooks */

/* Calls of one function, or of all with NULL; unknown names count 0. */
unsigned long long fakeNvmlCallCount(const char *name)
{
    unsigned long long total = 0;
    for (int i = 0; i < FN_COUNT; i++)
        if (!name || strcmp(name, fn_names[i]) == 0)
            total += __atomic_load_n(&g_calls[i], __ATOMIC_RELAXED);
    return total;
}

void fakeNvmlResetCallCounts(void)
{
    for (int i = 0; i < FN_COUNT; i++)
        __atomic_store_n(&g_calls[i], 0, __ATOMIC_RELAXED);
}

/* ------------------------------------------------------- process lifecycle */

/* A fork while another thread holds g_lock would leave the child's copy
 * locked forever; holding it across fork() hands the child a free lock. */
static void before_fork(void)
{
    pthread_mutex_lock(&g_lock);
}

static void after_fork(void)
{
    pthread_mutex_unlock(&g_lock);
}

__attribute__((constructor)) static void fake_nvml_load(void)
{
    for (unsigned int i = 0; i < MAX_DEVICES; i++)
        g_handles[i].index = i;
    qsort(dev_keys, N_DEV_KEYS, sizeof dev_keys[0], key_cmp);
    pthread_atfork(before_fork, after_fork, after_fork);
}

/* FAKE_NVML_COUNTS=<file>: "<function> <calls>" lines at normal exit. */
__attribute__((destructor)) static void fake_nvml_unload(void)
{
    const char *path = getenv("FAKE_NVML_COUNTS");
    if (!path || !*path)
        return;
    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof tmp, "%s.%d.tmp", path, (int)getpid()) >= (int)sizeof tmp)
        return;
    FILE *f = fopen(tmp, "w");
    if (!f)
        return;
    for (int i = 0; i < FN_COUNT; i++) {
        unsigned long long n = __atomic_load_n(&g_calls[i], __ATOMIC_RELAXED);
        if (n)
            fprintf(f, "%s %llu\n", fn_names[i], n);
    }
    if (fclose(f) == 0)
        rename(tmp, path);
    else
        unlink(tmp);
}
